"""int8 weights for decoding on a CPU (``--precision int8`` of eval and generate).

Every linear layer becomes torch's dynamically quantized linear: weights stored once as int8, one
scale per output row; activations quantized per call; products on int8 kernels. The output
projection, the largest product of a decoding step at "base", keeps its fp32 weight beside the int8
copy, for the loss and for the target embeddings it is tied to. On CPUs with AMX the weights are
packed for oneDNN, whose AMX kernels multiply 5-8x faster than the default engine's (FBGEMM) here.
Measured (benchmarks/README.md, "int8 decoding"): test2016 BLEU within 0.2 of fp32, and faster than
CTranslate2's int8 at "small" and "base".
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swap int8 linear layers into the plain model (in place; returned). Unchanged, with one
    warning, where this torch no longer offers dynamically quantized linear layers."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
        from torch.ao.quantization import per_channel_dynamic_qconfig
    except ImportError:
        from tformer_cli.render import warn

        warn("--precision int8: this torch has no torch.ao.nn.quantized.dynamic.Linear; decoding in fp32")
        return model

    def int8(linear: nn.Linear) -> nn.Module:
        shadow = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
        shadow.weight, shadow.bias, shadow.qconfig = linear.weight, linear.bias, per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao at every call
            warnings.simplefilter("ignore")
            return DynamicInt8Linear.from_float(shadow)

    engine = torch.backends.quantized.engine
    if _has_cpu_flag("amx_int8") and "onednn" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "onednn"  # packing picks the kernels; restored below
    try:
        _swap(model, int8)
        model.output_proj = Int8Projection(model.output_proj, int8(model.output_proj))
    finally:
        torch.backends.quantized.engine = engine
    return model


def _swap(module: nn.Module, int8) -> None:
    for name, child in module.named_children():
        if type(child) is nn.Linear and name != "output_proj":
            setattr(module, name, int8(child))
        else:
            _swap(child, int8)


class Int8Projection(nn.Module):
    """The output projection with int8 products, its fp32 weight kept (the loss reads it; it may be
    the target embedding's too)."""

    def __init__(self, linear: nn.Linear, quantized: nn.Module) -> None:
        super().__init__()
        self.weight, self.bias, self.quantized = linear.weight, linear.bias, quantized

    def forward(self, x: Tensor) -> Tensor:
        return self.quantized(x)


def _has_cpu_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and flag in line.split() for line in cpuinfo)
    except OSError:
        return False
