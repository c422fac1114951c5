"""Linear layers that, at inference on a CPU, multiply by a copy of their weight packed for oneDNN.

A decoding step multiplies a few dozen rows (sentences x beams) by every weight matrix. ``F.linear``
hands such products to MKL with the weight as stored, and with few rows they are bound by reading
the weight, not by arithmetic. Packed once into oneDNN's blocked layout (what ``torch.compile``'s
freezing pass does for inference), the same products run several times faster (benchmarks/README.md).
Training, fp16, other devices, many rows and small weights keep ``F.linear`` (see the constants
below). The packed copy lives on the module, outside the state dict, is rebuilt when the weight
changes (an optimizer step, loading or averaging checkpoints) and is dropped by ``.train()``, so
training does not hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer_cli.accel import gemm, heap
from tformer_cli.accel.ops import LINEAR_POINTWISE, REORDER_LINEAR_WEIGHT, native_on_cpu

PACKING = LINEAR_POINTWISE is not None and REORDER_LINEAR_WEIGHT is not None
# oneDNN's bf16 products need AVX-512 (or AVX-NE-CONVERT); elsewhere torch's op raises instead
PACKING_BF16 = PACKING and native_on_cpu("bf16")
# oneDNN builds a kernel for every new row count (then caches it, ~0.6 MB each), so rows are padded
# (see _padded_rows). Packing pays where reading the weight dominates: up to MAX_ROWS rows (an encoder
# batch of thousands gained little) and weights of MIN_WEIGHT elements or more (below, oneDNN's call
# overhead ate the gain); under bf16 autocast, which casts the weight at every call, from smaller ones.
# Smaller weights are packed too where their unpacked product would run on oneDNN anyway (gemm.py, on
# AMD CPUs with AVX-512): as fast, and with padded rows they need a few kernels instead of one per row count.
ROW_MULTIPLE = 8
# in training, whose heap keeps every kernel, validation pads to multiples of 16: fewer kernels to build
VALIDATION_ROW_MULTIPLE = 16
MAX_ROWS = 1024
MIN_WEIGHT = 2**17
MIN_WEIGHT_AUTOCAST = 2**16


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class FastLinear(nn.Linear):
    """``nn.Linear``, optionally followed by an activation (``relu`` or ``gelu``); without autograd on
    a CPU, in fp32 or under bf16 autocast, computed from a oneDNN-packed weight where that pays, with
    the activation applied by the same call. Made from a plain layer by ``of``, sharing its parameters."""

    row_multiple = ROW_MULTIPLE  # rows are padded to a multiple of this; training raises it (build_decoding_kernels)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 **kwargs) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        self.activation = activation

    @classmethod
    def of(cls, plain: nn.Linear, activation: str | None = None) -> "FastLinear":
        """A FastLinear holding ``plain``'s own weight and bias (so tied weights stay tied)."""
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.in_features, fast.out_features, fast.activation = plain.in_features, plain.out_features, activation
        fast.weight, fast.bias = plain.weight, plain.bias
        return fast.train(plain.training)

    def forward(self, x: Tensor) -> Tensor:
        if not PACKING or torch.is_grad_enabled() or not x.is_cpu or self.weight.dtype != torch.float32:
            return self._unpacked(x)
        n = x.numel() // self.in_features  # rows
        dtype = _packed_dtype(x)
        min_weight = MIN_WEIGHT if dtype == torch.float32 else MIN_WEIGHT_AUTOCAST
        small = self.in_features * self.out_features < min_weight
        if dtype is None or n == 0 or n > MAX_ROWS or (small and not gemm.on_onednn(x, self.weight)):
            return self._unpacked(x)
        padded = _padded_rows(n, self.row_multiple)
        weight, bias = self._packed_weight(dtype, padded)
        attr = self.activation or "none"
        algorithm = "none" if self.activation == "gelu" else ""  # the erf form, as F.gelu
        if padded == n:  # the op flattens the leading dimensions itself
            return LINEAR_POINTWISE(x.to(dtype), weight, bias, attr, [], algorithm)
        rows = gemm.zero_rows_to(x.reshape(n, self.in_features).to(dtype), padded)
        out = LINEAR_POINTWISE(rows, weight, bias, attr, [], algorithm)[:n]
        return out.view(*x.shape[:-1], self.out_features)

    def _unpacked(self, x: Tensor) -> Tensor:
        out = gemm.linear(x, self.weight, self.bias)
        if self.activation == "relu" and not torch.is_grad_enabled():
            return out.relu_()  # in place at inference, saving a copy; training keeps relu's input
        return ACTIVATIONS[self.activation](out) if self.activation else out

    def train(self, mode: bool = True) -> "FastLinear":
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
            cache = (version, dtype, source, REORDER_LINEAR_WEIGHT(source.to(dtype), rows), bias)
            self._packed = cache
        return cache[3], cache[4]


def build_decoding_kernels(model: nn.Module, max_rows: int) -> int:
    """Compile now, side by side at the bottom of the heap, the kernels that decoding batches of up to
    ``max_rows`` hypotheses would have oneDNN build as they meet each row count; returns how many
    products were made (one per layer shape and padded row count).

    Training validates by decoding, and each validation of a better model finishes sentences at other
    steps, so meets row counts the last one did not: built then, their kernels (~0.6 MB each) land
    between the training step's buffers and pin the heap around them. A Multi30k run validating every
    150 steps grew at every validation to 1,434 MiB; with this build first it stayed at 1,225-1,249
    (benchmarks/README.md, "Validation's decoding kernels built before training"). Every layer shape
    is multiplied once at every padded row count, with zeros; the packed copies made for it are dropped.
    The model's layers then pad to multiples of VALIDATION_ROW_MULTIPLE, as built: 16 row counts up to
    256 instead of 24 (16 everywhere cost beam search at "base" 4 %, so eval and generate keep 8)."""
    if not PACKING or max_rows < 1:
        return 0
    layers: dict[tuple, FastLinear] = {}  # one layer of each shape: oneDNN's kernels are per shape
    for layer in model.modules():
        if isinstance(layer, FastLinear):
            layer.row_multiple = VALIDATION_ROW_MULTIPLE
            layers.setdefault((layer.in_features, layer.out_features, layer.bias is not None, layer.activation), layer)
    # largest first: the weight is packed for the first row count it meets, as decoding's first, full, batch
    sizes = sorted({_padded_rows(n, VALIDATION_ROW_MULTIPLE) for n in range(1, min(max_rows, MAX_ROWS) + 1)},
                   reverse=True)
    built = 0
    with torch.no_grad(), heap.compact():
        for layer in layers.values():  # each call packs or not as decoding's would (``forward``)
            for rows in sizes:
                layer(layer.weight.new_zeros(rows, layer.in_features))
                built += 1
            layer.__dict__.pop("_packed", None)  # made for the build; decoding packs the weights it has then
    return built


def _padded_rows(n: int, multiple: int = ROW_MULTIPLE) -> int:
    """Decoding's row counts: 8 sizes per power of two, multiples of ``multiple`` (24 up to 256 for
    multiples of 8, 16 for multiples of 16), for at most 12.5 % of padding above 128 rows."""
    return gemm.rounded_rows(n, 8, multiple)


def _packed_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype to multiply ``x`` in with a packed weight, or None to use F.linear."""
    if torch.is_autocast_enabled("cpu"):  # autocast would cast the weight again at every call
        return torch.bfloat16 if PACKING_BF16 and torch.get_autocast_dtype("cpu") == torch.bfloat16 else None
    return torch.float32 if x.dtype == torch.float32 else None


def _version(weight: Tensor) -> int | None:
    """How often the weight was modified in place (torch's private counter); None for inference
    tensors, which do not count, and where this torch has no such counter (then it is packed anew)."""
    try:
        return weight._version
    except (RuntimeError, AttributeError):
        return None


class FastFeedForward(nn.Module):
    """The model's PositionwiseFeedForward with its activation applied by the first product's call;
    training on oneDNN pads the rows once for both products (``gemm.padded_rows``)."""

    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        activation = "relu" if isinstance(ffn.activation, nn.ReLU) else "gelu"
        self.linear1 = FastLinear.of(ffn.linear1, activation)
        self.linear2 = FastLinear.of(ffn.linear2)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        padded = gemm.padded_rows(rows)
        if padded == rows or not torch.is_grad_enabled() or not gemm.on_onednn(x, self.linear1.weight):
            return self.linear2(self.linear1(x))  # (B, T, d_ff) -> (B, T, d_model)
        # training on oneDNN: the rows padded once for both products, not each product's input apart
        flat = gemm.zero_rows_to(x.reshape(rows, x.shape[-1]), padded)  # (padded, d_model)
        return self.linear2(self.linear1(flat))[:rows].view(x.shape)
