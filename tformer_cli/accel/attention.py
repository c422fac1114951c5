"""Equation 1 on a CPU, routed to whichever of torch's kernels is fastest for the call at hand.

``CpuAttention`` stands in for the model's ``ScaledDotProductAttention`` (``accelerate`` swaps it in)
and gives the same results (tests/test_accel.py). Its choices, each measured (benchmarks/README.md):

- one fp32 query per row at inference (greedy decoding's cross-attention) takes two batched products
  over contiguous keys instead of torch's fused kernel, whose blocks read keys that the step's other
  layers have evicted from cache;
- bf16/fp16 inputs run torch's fused CPU kernel in fp32 where its low-precision path is slow: in
  training (its bf16 backward is slower than fp32's) and, without AMX, in decoding, whose cache is
  then kept in fp32 (``cache_dtype``);
- attention dropout on a CPU draws its mask with ``accel.dropout`` (torch's CPU kernel falls back to
  its math path and a slow mask there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer_cli.accel.dropout import dropout
from tformer_cli.accel.ops import amx
from tformer_cli.model.attention import ScaledDotProductAttention, and_masks, attention_weights, causal_for

BF16_ATTENTION = amx()  # torch's fused CPU kernel is fast in bf16 only with AMX tiles


class CpuAttention(ScaledDotProductAttention):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
                need_weights: bool = False, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if q.device.type != "cpu":
            return super().forward(q, k, v, mask, dropout_p, need_weights, is_causal)
        if is_causal and (mask is not None or q.shape[-2] != k.shape[-2]):
            mask = causal_for(q, k) if mask is None else and_masks(mask, causal_for(q, k))
            is_causal = False
        if not need_weights and dropout_p == 0.0 and not _one_fp32_query(q, k):
            if _fp32_kernel(q, k):
                mask = mask.float() if mask is not None and mask.is_floating_point() else mask
                with torch.autocast("cpu", enabled=False):
                    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                         is_causal=is_causal)
                return out.to(q.dtype), None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal), None
        weights = attention_weights(q, k.to(q.dtype), mask, is_causal)  # the cache may keep fp32 (cache_dtype)
        out = dropout(weights, dropout_p) @ v.to(q.dtype)  # (B, H, T_q, d_k)
        return out, weights if need_weights else None

    def cache_dtype(self, like: Tensor) -> torch.dtype:
        """fp32 for bf16 keys on a CPU without AMX and for fp16, where torch's kernel is slower on one
        low-precision query than in fp32 and casting the cache at every step costs as much."""
        return torch.float32 if like.device.type == "cpu" and _slow_in(like.dtype) else like.dtype


def _one_fp32_query(q: Tensor, k: Tensor) -> bool:
    """One fp32 query per row against contiguous keys, at inference: greedy decoding's cross-attention."""
    return (q.shape[-2] == 1 and q.dtype == k.dtype == torch.float32 and k.is_contiguous()
            and not torch.is_grad_enabled())


def _fp32_kernel(q: Tensor, k: Tensor) -> bool:
    """Whether to run the fused kernel in fp32 on bf16/fp16 inputs (the inputs are small next to the
    matrix products, which stay in low precision)."""
    return q.dtype in (torch.bfloat16, torch.float16) and (q.requires_grad or k.dtype == torch.float32
                                                             or _slow_in(q.dtype))


def _slow_in(dtype: torch.dtype) -> bool:
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not BF16_ATTENTION)
