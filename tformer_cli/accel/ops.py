"""Every private torch API that tformer uses, looked up once, here.

Each is an underscored op that torch.compile or torch's own modules use but does not promise to keep.
Where this torch lacks one, it is None (or a plain fallback) and the speed-up that needs it is skipped,
after one warning: the results stay the same, only slower.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch


def _private(owner: Any, name: str, use: str) -> Callable | None:
    op = getattr(owner, name, None)
    if op is None:
        warnings.warn(f"torch {torch.__version__} has no {name}: {use} runs on the plain path", stacklevel=2)
    return op


_MKLDNN = torch.ops.mkldnn if torch.backends.mkldnn.is_available() else None

# oneDNN products with an unpacked or packed weight (torch.compile's CPU linear layers)
LINEAR_POINTWISE = _private(_MKLDNN, "_linear_pointwise", "oneDNN's matrix products") if _MKLDNN else None
REORDER_LINEAR_WEIGHT = _private(_MKLDNN, "_reorder_linear_weight", "packing weights for decoding") \
    if _MKLDNN else None
_BF16_SUPPORTED = getattr(_MKLDNN, "_is_mkldnn_bf16_supported", None) if _MKLDNN else None
_FP16_SUPPORTED = getattr(_MKLDNN, "_is_mkldnn_fp16_supported", None) if _MKLDNN else None
_AMX = getattr(torch.cpu, "_is_amx_tile_supported", None)
_LOG_SOFTMAX_OUT = getattr(getattr(torch.ops.aten, "_log_softmax", None), "out", None)
try:  # torch.compile's shape settings
    import torch.fx.experimental._config as _FX_CONFIG
except ImportError:
    _FX_CONFIG = None
_FOREACH_LERP = getattr(torch, "_foreach_lerp_", None)


def native_on_cpu(precision: str) -> bool:
    """Whether oneDNN has native kernels for bf16 / fp16 here (AVX-512 BF16 or AMX, AVX-512 FP16);
    False where this torch cannot tell."""
    probe = _BF16_SUPPORTED if precision == "bf16" else _FP16_SUPPORTED
    return bool(probe()) if probe is not None else False


def amx() -> bool:
    """Whether this CPU has AMX tiles (torch's fused bf16 CPU attention is fast only with them)."""
    return bool(_AMX()) if _AMX is not None else False


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension, written over ``x`` where this torch can (its kernel reads
    each row before writing it), else into a new tensor."""
    if _LOG_SOFTMAX_OUT is None:
        return torch.log_softmax(x, dim=-1)
    return _LOG_SOFTMAX_OUT(x, -1, False, out=x)


def dynamic_sizes_only(compiled: Callable) -> Callable:
    """``compiled`` (a torch.compile'd function with dynamic shapes), run so that only sizes are
    symbols, each a symbol of its own:

    - by default sizes that are equal in the first call share one ("duck sizing"): when a first batch's
      source and target happened to be equally long, the next batch compiled the whole model again;
    - by default Python floats (dropout rates, norm epsilons, the embedding scale, module attributes
      all) become symbols too, until tracing finds they cannot stay symbols and starts again with them
      as constants: a second trace of the whole model, about 10 of base's 56 s of compiling on a CPU.

    Only this function's compilations are affected."""
    if not hasattr(_FX_CONFIG, "use_duck_shape"):
        warnings.warn(f"torch {torch.__version__} has no use_duck_shape: torch.compile may compile the model "
                      "twice", stacklevel=2)
        return compiled

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _FX_CONFIG.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return call


def foreach_lerp_(targets: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    """targets[i] += weight * (ends[i] - targets[i]), in one kernel per dtype and device where torch has it."""
    if _FOREACH_LERP is not None:
        _FOREACH_LERP(targets, ends, weight)
        return
    for target, end in zip(targets, ends):
        target.lerp_(end, weight)
