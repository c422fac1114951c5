"""Attention (Vaswani et al. 2017, §3.2): scaled dot-product attention, masks, multi-head attention.

Masks are boolean and broadcast to (B, H, T_q, T_k); True means "may attend", the convention of
``torch.nn.functional.scaled_dot_product_attention``. A float mask is added to the scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, T) token ids -> (B, 1, 1, T) boolean mask, True at real (non-pad) keys."""
    return (tokens != pad_id)[:, None, None, :]


def segment_mask(q_segments: Tensor, k_segments: Tensor) -> Tensor:
    """(B, T_q), (B, T_k) sentence numbers of packed rows' tokens (0 on padding) -> (B, 1, T_q, T_k)
    boolean mask: a sentence's tokens attend within it. Padding queries attend to every key, so that
    their rows stay finite (their outputs are never used)."""
    same = q_segments[:, :, None] == k_segments[:, None, :]  # (B, T_q, T_k)
    return (same | (q_segments == 0)[:, :, None])[:, None]


def causal_mask(length: int, device: torch.device | None = None) -> Tensor:
    """(T, T) boolean mask, True on and below the diagonal: position i sees positions <= i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (§3.2.1, equation 1).

    Args:
        q: (B, H, T_q, d_k); k, v: (B, H, T_k, d_k).
        mask: boolean (True = attend) or additive float, broadcastable to (B, H, T_q, T_k).
        dropout_p: dropout on the attention weights (training only).
        need_weights: take the explicit path and also return the (B, H, T_q, T_k) weights.
        is_causal: add the causal mask (query i attends keys <= i + T_k - T_q).

    Returns:
        (output (B, H, T_q, d_k), weights or None).
    """
    if is_causal and (mask is not None or q.shape[-2] != k.shape[-2]):  # torch's is_causal aligns to the start
        mask = causal_for(q, k) if mask is None else and_masks(mask, causal_for(q, k))
        is_causal = False
    if not need_weights:  # torch's fused kernels (flash / memory-efficient on CUDA)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal), None
    weights = attention_weights(q, k, mask, is_causal)
    out = F.dropout(weights, dropout_p) @ v  # (B, H, T_q, d_k)
    return out, weights


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool = False) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) with the mask applied (the explicit path): (B, H, T_q, T_k)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T_q, T_k)
    if is_causal:
        mask = causal_for(q, k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(dim=-1)


class ScaledDotProductAttention(nn.Module):
    """Equation 1 as a module, so that a faster kernel can stand in for it (``tformer_cli.accel``)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
                need_weights: bool = False, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        return scaled_dot_product_attention(q, k, v, mask, dropout_p, need_weights, is_causal)

    def cache_dtype(self, like: Tensor) -> torch.dtype:
        """The dtype to keep decoding's keys and values in: that of the keys."""
        return like.dtype


def causal_for(q: Tensor, k: Tensor) -> Tensor:
    """Causal mask aligned to the end: the last query sees every key (incremental decoding)."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    return torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)


def and_masks(mask: Tensor, causal: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


class KVCache:
    """Self-attention keys and values of the tokens decoded so far, for one layer.

    Storage is one time-major buffer, (capacity, B, 2, H, d_k) for keys and values together: the
    filled part is a single contiguous block, so appending writes one slot, and reordering beams or
    dropping finished sentences is one ``index_select`` straight into the new buffer. The buffer is
    doubled when full, so appending T tokens one by one costs O(T) copies, not O(T^2).
    """

    def __init__(self, capacity: int = 64, dtype_for: Callable[[Tensor], torch.dtype] | None = None) -> None:
        self.capacity = capacity
        self.dtype_for = dtype_for  # the dtype to store keys like these in (default: theirs)
        self.length = 0
        self.kv: Tensor | None = None  # (capacity, B, 2, H, d_k)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add (B, H, T_new, d_k) keys/values; return (B, H, T, d_k) views of all of them so far."""
        new_length = self.length + k.shape[2]
        if self.kv is None or new_length > self.kv.shape[0]:
            self._grow(k, max(new_length, 2 * (self.kv.shape[0] if self.kv is not None else self.capacity)))
        self.kv[self.length:new_length, :, 0] = k.permute(2, 0, 1, 3)
        self.kv[self.length:new_length, :, 1] = v.permute(2, 0, 1, 3)
        self.length = new_length
        return self.keys(), self.values()

    def keys(self) -> Tensor:
        return self.kv[:self.length, :, 0].permute(1, 2, 0, 3)

    def values(self) -> Tensor:
        return self.kv[:self.length, :, 1].permute(1, 2, 0, 3)

    def _grow(self, like: Tensor, capacity: int) -> None:
        B, H, _, d_k = like.shape
        kv = like.new_empty(capacity, B, 2, H, d_k, dtype=self.dtype_for(like) if self.dtype_for else like.dtype)
        if self.kv is not None:
            kv[:self.length] = self.kv[:self.length]
        self.kv = kv

    def select(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (reorder beams, or drop finished sentences)."""
        if self.kv is None:
            return
        kv = self.kv.new_empty((self.kv.shape[0], index.numel()) + self.kv.shape[2:])
        torch.index_select(self.kv[:self.length], 1, index, out=kv[:self.length])
        self.kv = kv


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O  (§3.2.2).

    Self-attention projects Q, K and V with one fused matrix; cross-attention projects the queries
    from the decoder and K, V (fused) from the encoder output ("memory"). Heads are a batch
    dimension: (B, T, d_model) -> (B, H, T, d_k). The projections W^Q, W^K, W^V and W^O are matrices,
    as in the paper (and tensor2tensor); ``bias`` adds a bias to each, as ``nn.MultiheadAttention``
    and Marian do.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, cross: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.dropout = dropout
        self.cross = cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.attention = ScaledDotProductAttention()
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.d_k).transpose(1, 2)  # (B, H, T, d_k)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the encoder output, computed once per source."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # (B, S, d_model) each
        return self.split_heads(k), self.split_heads(v)  # (B, H, S, d_k)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
        memory_kv: tuple[Tensor, Tensor] | None = None,
        rotary: "RotaryEmbedding | None" = None,
        position: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (B, T, d_model) to itself, or to ``memory`` when cross.

        Args:
            mask: boolean or additive, broadcastable to (B, H, T, T_k).
            cache: self-attention K/V of earlier steps; the new K/V are appended to it.
            memory_kv: precomputed cross-attention K/V (see ``project_memory``), for B or for B / n rows
                when each consecutive n rows of x share one (the beams of a sentence).
            rotary: rotary position embedding applied to q and k (self-attention only).
            position: index of x's first token (for rotary embeddings while decoding).

        Returns:
            (output (B, T, d_model), weights (B, H, T, T_k) or None).
        """
        B, T, d_model = x.shape
        if self.cross:
            k, v = memory_kv if memory_kv is not None else self.project_memory(memory)  # (B_mem, H, S, d_k)
            # Beam search keeps one memory row per sentence for its B / B_mem consecutive beams: their
            # queries attend together, as more queries of one row.
            q = self.split_heads(self.q_proj(x).view(k.shape[0], -1, d_model))  # (B_mem, H, B / B_mem * T, d_k)
        else:
            q, k, v = self.qkv_proj(x).view(B, T, 3, self.num_heads, self.d_k).permute(2, 0, 3, 1, 4)
            if rotary is not None:
                q, k = rotary(q, position), rotary(k, position)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, position + T, d_k)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = self.attention(q, k, v, mask, dropout_p, need_weights, is_causal)
        out = out.transpose(1, 2).reshape(B, T, d_model)  # concatenate heads (and ungroup beams): (B, T, d_model)
        if weights is not None and q.shape[0] != B:  # ungroup beams: (B_mem, H, n * T, S) -> (B, H, T, S)
            weights = weights.unflatten(2, (-1, T)).transpose(1, 2).flatten(0, 1)
        return self.out_proj(out), weights


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021): rotates pairs of q/k channels by position."""

    def __init__(self, d_k: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, d_k, 2).float() / d_k)  # (d_k / 2,)
        angles = torch.arange(max_len).float()[:, None] * inv_freq  # (max_len, d_k / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, position: int = 0) -> Tensor:
        T = x.shape[-2]
        return rotate(x, self.cos[position:position + T], self.sin[position:position + T])


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(B, H, T, d_k) with each pair of channels rotated by the angles of ``cos``, ``sin`` (T, d_k / 2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, T, d_k / 2)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)  # (B, H, T, d_k)


def alibi_slopes(num_heads: int) -> Tensor:
    """Per-head slopes of ALiBi (Press et al. 2022): a geometric sequence starting at 2^(-8/H)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    if closest < num_heads:  # the paper's recipe for head counts that are not powers of two
        extra = [2 ** (-4 * (i + 1) / closest) for i in range(2 * (num_heads - closest))][::2]
        slopes += extra
    return torch.tensor(slopes[:num_heads])


def alibi_bias(slopes: Tensor, t_q: int, t_k: int, offset: int = 0) -> Tensor:
    """(H, T_q, T_k) additive bias -slope * |i - j|; query i sits at position offset + i."""
    q_pos = torch.arange(offset, offset + t_q, device=slopes.device)[:, None]
    k_pos = torch.arange(t_k, device=slopes.device)[None, :]
    return distance_bias(slopes, q_pos, k_pos)


def distance_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(H,) slopes, query positions (T_q, 1) and key positions (1, T_k) -> (H, T_q, T_k) bias -slope * |i - j|."""
    return -slopes[:, None, None] * (q_pos - k_pos).abs()
