"""int8 weights for decoding on a CPU (``--precision int8`` of eval and generate).

Every linear layer but the output projection (whose fp32 weight the loss reads, and which is tied to
the embeddings) becomes torch's dynamically quantized linear: weights stored as int8 once,
activations quantized per call, products on int8 kernels (VNNI / AMX where the CPU has them).
On Multi30k's small model this decodes test2016 1.3x as fast as fp32 with BLEU within 0.2
(benchmarks/README.md, "int8 decoding").
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def quantize_int8(model: nn.Module) -> nn.Module:
    """The plain model (``accelerate`` not applied) with int8 linear layers; unchanged, with one
    warning, where this torch no longer offers dynamic quantization."""
    try:
        from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic
    except ImportError:
        from tformer_cli.render import warn

        warn("--precision int8: this torch has no torch.ao.quantization.quantize_dynamic; decoding in fp32")
        return model
    layers = {name: default_dynamic_qconfig for name, module in model.named_modules()
              if type(module) is nn.Linear and module is not model.output_proj}
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao at every call
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, layers, dtype=torch.qint8)
