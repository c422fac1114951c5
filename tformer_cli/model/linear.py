"""Linear layers that, at inference on a CPU, multiply by a copy of their weight packed for oneDNN.

A decoding step multiplies a few dozen rows (sentences x beams) by every weight matrix. ``F.linear``
hands such products to MKL with the weight as stored, and with few rows they are bound by reading
the weight, not by arithmetic. Packed once into oneDNN's blocked layout (what ``torch.compile``'s
freezing pass does for inference), the same products ran 1.3-2x faster for 64 rows and 3-4x faster
for 4-16 rows on a 2-core AVX-512 CPU, the vocabulary projection most; under bf16 autocast, which
casts the weight at every call, 2-4x. Training, fp16, other devices, many rows and small weights
keep ``F.linear`` (see the constants below). The packed copy lives on the module, outside the state
dict, is rebuilt when the weight changes (an optimizer step, loading or averaging checkpoints) and is
dropped by ``.train()``, so training does not hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer_cli.model import gemm

# torch's own (underscored) ops behind torch.compile's CPU weight packing; where absent, F.linear
PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN's bf16 products need AVX-512 (or AVX-NE-CONVERT); elsewhere torch's op raises instead
PACKING_BF16 = PACKING and torch.ops.mkldnn._is_mkldnn_bf16_supported()
# oneDNN builds a kernel for every new row count (~0.8 ms, then cached), so rows are padded (see
# _padded_rows). Packing pays where reading the weight dominates: up to MAX_ROWS rows (beam search
# over a batch of sentences; an encoder batch of thousands gained only ~10 %) and weights of
# MIN_WEIGHT elements or more (below, oneDNN's ~12 us call overhead ate the gain). Under bf16 autocast
# F.linear also casts the weight at every call, so packing pays from smaller weights: with the 256 x 256
# projections packed too, a d_model-256 decoding step took 8 % less time on a 2-core AMX CPU.
ROW_MULTIPLE = 8
MAX_ROWS = 1024
MIN_WEIGHT = 2**17
MIN_WEIGHT_AUTOCAST = 2**16


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class Linear(nn.Linear):
    """``nn.Linear``, optionally followed by an activation (``relu`` or ``gelu``); without autograd on
    a CPU, in fp32 or under bf16 autocast, computed from a oneDNN-packed weight where that pays, with
    the activation applied by the same call."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 **kwargs) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        if not PACKING or torch.is_grad_enabled() or not x.is_cpu or self.weight.dtype != torch.float32:
            return self._unpacked(x)
        n = x.numel() // self.in_features  # rows
        dtype = _packed_dtype(x)
        min_weight = MIN_WEIGHT if dtype == torch.float32 else MIN_WEIGHT_AUTOCAST
        if dtype is None or n == 0 or n > MAX_ROWS or self.in_features * self.out_features < min_weight:
            return self._unpacked(x)
        padded = _padded_rows(n)
        weight, bias = self._packed_weight(dtype, padded)
        attr = self.activation or "none"
        algorithm = "none" if self.activation == "gelu" else ""  # the erf form, as F.gelu
        if padded == n:  # the op flattens the leading dimensions itself
            return torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, bias, attr, [], algorithm)
        rows = x.reshape(n, self.in_features).to(dtype)
        rows = torch.cat([rows, rows.new_zeros(padded - n, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, attr, [], algorithm)[:n]
        return out.view(*x.shape[:-1], self.out_features)

    def _unpacked(self, x: Tensor) -> Tensor:
        out = gemm.linear(x, self.weight, self.bias)
        if self.activation == "relu" and not torch.is_grad_enabled():
            return out.relu_()  # in place at inference (an encoder batch: +2 % greedy); training keeps relu
        return ACTIVATIONS[self.activation](out) if self.activation else out

    def train(self, mode: bool = True) -> "Linear":
        if mode:  # training will change the weight: drop the packed copy instead of holding it stale
            self.__dict__.pop("_packed", None)
        return super().train(mode)

    def _packed_weight(self, dtype: torch.dtype, rows: int) -> tuple[Tensor, Tensor | None]:
        """The packed weight and the bias in ``dtype``, packed again whenever the weight has changed."""
        weight = self.weight
        version = _version(weight)
        cache = self.__dict__.get("_packed")  # (version, dtype, weight it was packed from, packed weight, bias)
        if cache is None or version is None or cache[0] != version or cache[1] != dtype \
                or cache[2].data_ptr() != weight.data_ptr():
            source = weight.detach()  # held, so no other tensor can take its address
            bias = None if self.bias is None else self.bias.detach().to(dtype)
            cache = (version, dtype, source, torch.ops.mkldnn._reorder_linear_weight(source.to(dtype), rows), bias)
            self._packed = cache
        return cache[3], cache[4]


def _padded_rows(n: int) -> int:
    """n rounded up to one of 8 sizes per power of two (multiples of ROW_MULTIPLE at least): few distinct
    row counts, so few kernels to build, for at most 12.5 % of padding."""
    step = max(ROW_MULTIPLE, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _packed_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype to multiply ``x`` in with a packed weight, or None to use F.linear."""
    if torch.is_autocast_enabled("cpu"):  # autocast would cast the weight again at every call
        return torch.bfloat16 if PACKING_BF16 and torch.get_autocast_dtype("cpu") == torch.bfloat16 else None
    return torch.float32 if x.dtype == torch.float32 else None


def _version(weight: Tensor) -> int | None:
    """How often the weight was modified in place; None for inference tensors, which do not count."""
    try:
        return weight._version
    except RuntimeError:
        return None
