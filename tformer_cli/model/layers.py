"""Position-wise FFN (§3.3), embeddings (§3.4), positional encoding (§3.5), and the two layer kinds.

Each sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-LN, the paper's §5.4) or,
as an option, x + Dropout(Sublayer(LayerNorm(x))) (pre-LN; the stack then ends with a LayerNorm).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tformer_cli.model.attention import KVCache, MultiHeadAttention, RotaryEmbedding

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2  (§3.3, equation 2); GELU as an option."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.activation = ACTIVATIONS[activation]()
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))  # (B, T, d_ff) -> (B, T, d_model)


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)  (§3.5). (max_len, d_model)"""
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d_model / 2,)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.float()


class TokenEmbedding(nn.Module):
    """Embeddings scaled by sqrt(d_model) (§3.4), plus the positional encoding, then dropout.

    ``positional`` is "sinusoidal" (the paper), "learned", or "rope"/"alibi", which add nothing here
    (they act inside attention). ``word_dropout`` zeroes whole token embeddings while training (scaling
    the rest by 1 / (1 - p)), so the model learns to translate with words missing; positions are kept.
    """

    def __init__(self, embedding: nn.Embedding, positional: str, max_len: int, dropout: float,
                 word_dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = embedding  # may be shared with the other side and the output projection
        self.scale = math.sqrt(embedding.embedding_dim)
        self.max_len = max_len
        d_model = embedding.embedding_dim
        self.learned = nn.Embedding(max_len, d_model) if positional == "learned" else None
        if positional == "sinusoidal":
            self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)
        else:
            self.table = None
        self.dropout = nn.Dropout(dropout)
        self.word_dropout = word_dropout

    def forward(self, tokens: Tensor, position: int = 0, positions: Tensor | None = None) -> Tensor:
        """(B, T) token ids starting at ``position`` -> (B, T, d_model); or each at its own place in
        its sentence, ``positions`` (B, T), for sentences packed into rows."""
        T = tokens.shape[1]
        if positions is None and position + T > self.max_len:
            raise ValueError(f"sequence of {position + T} tokens exceeds model.max_len {self.max_len}")
        scale = self.scale
        if self.training and self.word_dropout > 0:
            keep = torch.rand(tokens.shape, device=tokens.device) >= self.word_dropout  # (B, T)
            scale = keep.unsqueeze(-1) * (self.scale / (1.0 - self.word_dropout))  # (B, T, 1)
        x = self.embedding(tokens) * scale  # (B, T, d_model)
        places = slice(position, position + T) if positions is None else positions  # (T,) or (B, T)
        if self.table is not None:
            x = x + self.table[places]
        elif self.learned is not None:
            x = x + self.learned.weight[places]
        return self.dropout(x)


class EncoderLayer(nn.Module):
    """Self-attention, then FFN, each in a residual block with LayerNorm (§3.1, encoder)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation: str = "relu", norm_first: bool = False,
                 eps: float = 1e-5, attention_bias: bool = False) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, attention_dropout, bias=attention_bias)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, activation)
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, mask: Tensor | None, rotary: RotaryEmbedding | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """x: (B, S, d_model); mask: (B, 1|H, 1|S, S). Returns (x, self-attention weights or None)."""
        h, weights = self.self_attn(self.norm1(x) if self.norm_first else x, mask=mask, rotary=rotary,
                                    need_weights=need_weights)
        x = _residual(x, h, self.dropout, self.norm1, self.norm_first)
        x = _residual(x, self.ffn(self.norm2(x) if self.norm_first else x), self.dropout, self.norm2,
                      self.norm_first)
        return x, weights


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then FFN (§3.1, decoder)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation: str = "relu", norm_first: bool = False,
                 eps: float = 1e-5, attention_bias: bool = False) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, attention_dropout, bias=attention_bias)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, attention_dropout, cross=True, bias=attention_bias)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, activation)
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.norm3 = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, memory: Tensor | None, self_mask: Tensor | None, memory_mask: Tensor | None,
                is_causal: bool = True, cache: "DecoderLayerCache | None" = None,
                rotary: RotaryEmbedding | None = None, position: int = 0, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x: (B, T, d_model) target states; memory: (B, S, d_model) encoder output.

        ``is_causal`` adds the causal mask to ``self_mask`` (a single new token needs none).
        With a cache, x holds only the new tokens. Returns (x, self-attention weights,
        cross-attention weights); weights only if asked.
        """
        h, self_weights = self.self_attn(
            self.norm1(x) if self.norm_first else x, mask=self_mask, is_causal=is_causal,
            cache=cache.self_kv if cache else None, rotary=rotary, position=position, need_weights=need_weights)
        x = _residual(x, h, self.dropout, self.norm1, self.norm_first)
        h, cross_weights = self.cross_attn(
            self.norm2(x) if self.norm_first else x, memory=memory, mask=memory_mask,
            memory_kv=cache.memory_kv if cache else None, need_weights=need_weights)
        x = _residual(x, h, self.dropout, self.norm2, self.norm_first)
        x = _residual(x, self.ffn(self.norm3(x) if self.norm_first else x), self.dropout, self.norm3,
                      self.norm_first)
        return x, self_weights, cross_weights


def _residual(x: Tensor, sublayer_out: Tensor, dropout: nn.Dropout, norm: nn.LayerNorm, norm_first: bool) -> Tensor:
    """Post-LN: LayerNorm(x + Dropout(sublayer)); pre-LN: x + Dropout(sublayer) (the norm was applied to
    its input)."""
    x = x + dropout(sublayer_out)
    return x if norm_first else norm(x)


class DecoderLayerCache:
    """What one decoder layer keeps between decoding steps."""

    def __init__(self, memory_kv: tuple[Tensor, Tensor], capacity: int,
                 dtype_for: Callable[[Tensor], torch.dtype] | None = None) -> None:
        self.self_kv = KVCache(capacity, dtype_for)
        # cross-attention K/V, (B, H, S, d_k) each: fixed per source, made contiguous once (they are views
        # of the fused K/V projection) so that every step reads each head's keys as one block
        self.memory_kv = tuple((t.to(dtype_for(t)) if dtype_for else t).contiguous() for t in memory_kv)

    def select_memory(self, index: Tensor) -> None:
        """Keep the cross-attention K/V of sources ``index``."""
        self.memory_kv = (self.memory_kv[0].index_select(0, index), self.memory_kv[1].index_select(0, index))
