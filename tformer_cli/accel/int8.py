"""int8 weights for decoding on a CPU (``--precision int8`` of eval and generate).

Every linear layer becomes torch's dynamically quantized linear: weights stored once as int8, one
scale per output row; activations quantized per call; products on int8 kernels. The output
projection, the largest product of a decoding step at "base", keeps its fp32 weight beside the int8
copy, for the loss and for the target embeddings it is tied to. torch's default engine (FBGEMM)
packs them; oneDNN's, with AMX, was 5 % faster at "base" and 11 % slower at "small" on an Intel
Xeon. Measured (benchmarks/README.md, "int8 decoding"): test2016 BLEU within 0.25 of fp32, and
faster than CTranslate2's int8 at "small" and "base".
"""

from __future__ import annotations

import warnings

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

    _swap(model, int8)
    model.output_proj = Int8Projection(model.output_proj, int8(model.output_proj))
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

