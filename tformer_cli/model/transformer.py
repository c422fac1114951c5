"""The encoder-decoder Transformer (§3.1): encoder stack, decoder stack, output projection.

    src (B, S) -> embed + PE -> N x EncoderLayer -> memory (B, S, d_model)
    tgt (B, T) -> embed + PE -> N x DecoderLayer(memory) -> Linear -> logits (B, T, V)

``encode`` and ``decode`` are separate so that decoding (see ``tformer_cli.decoding``) runs the
encoder once and the decoder one token at a time with a key/value cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from tformer_cli.config import ModelConfig
from tformer_cli.model.attention import (
    RotaryEmbedding, alibi_bias, alibi_slopes, causal_mask, padding_mask, segment_mask)
from tformer_cli.model.layers import DecoderLayer, DecoderLayerCache, EncoderLayer, TokenEmbedding


@dataclass
class Encoded:
    """The encoder's output for a batch of sources."""

    memory: Tensor  # (B, S, d_model)
    mask: Tensor  # (B, 1, 1, S), True at real source tokens
    attention: list[Tensor] | None = None  # per layer (B, H, S, S), when asked for


@dataclass
class Rows:
    """Sentence pairs packed end to end into rows, as T5 packs its examples: for each token, the
    number of its sentence in its row (0 on padding) and its position in that sentence, on both sides.
    Attention stays within a sentence and positions restart at each, so a packed sentence is computed
    as it would be alone; rows carry far less padding than sentences padded to their batch's longest."""

    src_segments: Tensor  # (B, S)
    src_positions: Tensor  # (B, S)
    tgt_segments: Tensor  # (B, T)
    tgt_positions: Tensor  # (B, T)

    def map(self, fn: Callable[[Tensor], Tensor]) -> Rows:
        """The same rows with ``fn`` applied to each tensor (moved to a device, repeated for R-Drop)."""
        return Rows(*(fn(getattr(self, f.name)) for f in fields(self)))


@dataclass
class Decoded:
    hidden: Tensor  # (B, T, d_model), before the output projection
    self_attention: list[Tensor] | None = None  # per layer (B, H, T, T)
    cross_attention: list[Tensor] | None = None  # per layer (B, H, T, S)


class DecoderCache:
    """Per-layer self-attention K/V and cross-attention K/V for incremental decoding.

    With ``group`` n > 1 the decoder runs n rows per source (the beams of a sentence, consecutive):
    self-attention K/V have a row each, cross-attention K/V and the source mask one per source.
    """

    def __init__(self, layers: list[DecoderLayerCache], memory_mask: Tensor, group: int = 1) -> None:
        self.layers = layers
        # (B_src, 1, 1, S), or None where no source has padding: every step then attends without a mask
        self.memory_mask = None if bool(memory_mask.all()) else memory_mask
        self.group = group
        self.position = 0  # number of target tokens decoded so far

    def select(self, index: Tensor) -> None:
        """Keep rows ``index``: drop finished sentences (or reorder rows freely). With groups, the
        index keeps whole groups, in order (e.g. rows 4-7 and 0-3 for beam 4)."""
        sources = index if self.group == 1 else index[::self.group] // self.group
        for layer in self.layers:
            layer.self_kv.select(index)
            layer.select_memory(sources)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, sources)

    def reorder(self, index: Tensor) -> None:
        """Reorder rows within groups that share a source, such as the beams of one sentence: their
        cross-attention K/V and source mask are identical, so only the self-attention K/V move."""
        for layer in self.layers:
            layer.self_kv.select(index)


class Encoder(nn.Module):
    def __init__(self, embed: TokenEmbedding, layers: list[EncoderLayer], final_norm: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm  # LayerNorm for pre-LN, Identity for post-LN

    def forward(self, src: Tensor, mask: Tensor, rotary: RotaryEmbedding | None, slopes: Tensor | None,
                need_weights: bool = False, positions: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        x = self.embed(src, positions=positions)  # (B, S, d_model)
        if slopes is not None:  # ALiBi: distance bias, with padding keys removed
            S = src.shape[1]
            mask = alibi_bias(slopes, S, S)[None].masked_fill(~mask, float("-inf"))  # (B, H, S, S)
        weights = []
        for layer in self.layers:
            x, w = layer(x, mask, rotary=rotary, need_weights=need_weights)
            weights.append(w)
        return self.final_norm(x), weights


class Decoder(nn.Module):
    def __init__(self, embed: TokenEmbedding, layers: list[DecoderLayer], final_norm: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def forward(self, tgt: Tensor, memory: Tensor | None, memory_mask: Tensor | None, rotary: RotaryEmbedding | None,
                slopes: Tensor | None, cache: DecoderCache | None = None, need_weights: bool = False,
                positions: Tensor | None = None, self_mask: Tensor | None = None
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        position = cache.position if cache is not None else 0
        T = tgt.shape[1]
        x = self.embed(tgt, position, positions)  # (B, T, d_model)
        is_causal = cache is None or T > 1  # one new token needs no mask; ``self_mask``: packed rows' sentences
        if slopes is not None:  # ALiBi: causal distance bias over all positions so far
            bias = alibi_bias(slopes, T, position + T, offset=position)  # (H, T, position + T)
            allowed = causal_mask(position + T, tgt.device)[position:]  # (T, position + T)
            self_mask, is_causal = bias.masked_fill(~allowed, float("-inf"))[None], False
        self_weights, cross_weights = [], []
        for i, layer in enumerate(self.layers):
            x, sw, cw = layer(x, memory, self_mask, memory_mask, is_causal=is_causal,
                              cache=cache.layers[i] if cache is not None else None,
                              rotary=rotary, position=position, need_weights=need_weights)
            self_weights.append(sw)
            cross_weights.append(cw)
        if cache is not None:
            cache.position += T
        return self.final_norm(x), self_weights, cross_weights


class Transformer(nn.Module):
    """The full model. Build it with ``build_model(ModelConfig, ...)``."""

    def __init__(self, encoder: Encoder, decoder: Decoder, output_proj: nn.Linear, pad_id: int,
                 rotary: RotaryEmbedding | None = None, slopes: Tensor | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.output_proj = output_proj  # (V_tgt, d_model), optionally tied to the embeddings
        self.pad_id = pad_id
        self.rotary = rotary
        if slopes is not None:
            self.register_buffer("slopes", slopes, persistent=False)
        else:
            self.slopes = None

    def encode(self, src: Tensor, need_weights: bool = False, rows: Rows | None = None) -> Encoded:
        """(B, S) source ids -> Encoded(memory (B, S, d_model), mask, attention); ``rows``: the sources
        are sentences packed into rows (training only)."""
        if rows is None:
            mask, positions = padding_mask(src, self.pad_id), None  # (B, 1, 1, S)
        else:
            self._check_packable()
            mask, positions = segment_mask(rows.src_segments, rows.src_segments), rows.src_positions  # (B, 1, S, S)
        memory, weights = self.encoder(src, mask, self.rotary, self.slopes, need_weights, positions)
        return Encoded(memory, mask, weights if need_weights else None)

    def decode(self, tgt: Tensor, encoded: Encoded, cache: DecoderCache | None = None,
               need_weights: bool = False, rows: Rows | None = None) -> Decoded:
        """(B, T) target ids (only the new ones when ``cache`` is given) -> hidden states (B, T, d_model);
        ``rows``: the targets and ``encoded``'s sources are sentences packed into the same rows."""
        memory = None if cache is not None else encoded.memory
        memory_mask = cache.memory_mask if cache is not None else encoded.mask
        positions = self_mask = None
        if rows is not None:
            self._check_packable()
            memory_mask = segment_mask(rows.tgt_segments, rows.src_segments)  # (B, 1, T, S)
            self_mask, positions = segment_mask(rows.tgt_segments, rows.tgt_segments), rows.tgt_positions
        hidden, sw, cw = self.decoder(tgt, memory, memory_mask, self.rotary, self.slopes, cache, need_weights,
                                      positions, self_mask)
        return Decoded(hidden, sw if need_weights else None, cw if need_weights else None)

    def _check_packable(self) -> None:
        if self.rotary is not None or self.slopes is not None:
            raise ValueError("packed rows need model.positional sinusoidal or learned (RoPE and ALiBi place "
                             "tokens by their place in the row)")

    def logits(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> (..., V_tgt): the final linear layer of §3.4 (softmax left to the caller)."""
        return self.output_proj(hidden)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V_tgt) for source (B, S) and target input (B, T)."""
        return self.logits(self.decode(tgt, self.encode(src)).hidden)

    def start_cache(self, encoded: Encoded, capacity: int = 64, group: int = 1) -> DecoderCache:
        """An empty decoding cache; each layer's cross-attention K/V are computed here, once. With
        ``group`` n, the decoder will run n consecutive rows per source (beam search)."""
        layers = [DecoderLayerCache(layer.cross_attn.project_memory(encoded.memory), capacity,
                                    layer.self_attn.attention.cache_dtype) for layer in self.decoder.layers]
        return DecoderCache(layers, encoded.mask, group)


def build_model(config: ModelConfig, src_vocab_size: int, tgt_vocab_size: int | None = None,
                pad_id: int = 0) -> Transformer:
    """Compose the network described by ``config``. Source and target vocabularies must be equal
    when ``share_embeddings`` is "all"."""
    tgt_vocab_size = tgt_vocab_size or src_vocab_size
    c = config
    if c.share_embeddings == "all" and src_vocab_size != tgt_vocab_size:
        raise ValueError("share_embeddings 'all' needs one vocabulary for source and target")
    src_emb = nn.Embedding(src_vocab_size, c.d_model, padding_idx=pad_id)
    tgt_emb = src_emb if c.share_embeddings == "all" else nn.Embedding(tgt_vocab_size, c.d_model, padding_idx=pad_id)
    output_proj = nn.Linear(c.d_model, tgt_vocab_size, bias=False)
    norm_first = c.norm == "pre"
    layer_args = dict(d_model=c.d_model, num_heads=c.num_heads, d_ff=c.d_ff, dropout=c.dropout,
                      attention_dropout=c.attention_dropout, activation=c.activation, norm_first=norm_first,
                      eps=c.layer_norm_eps, attention_bias=c.attention_bias)

    def final_norm() -> nn.Module:
        return nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if norm_first else nn.Identity()

    encoder = Encoder(TokenEmbedding(src_emb, c.positional, c.max_len, c.dropout, c.word_dropout),
                      [EncoderLayer(**layer_args) for _ in range(c.num_encoder_layers)], final_norm())
    decoder = Decoder(TokenEmbedding(tgt_emb, c.positional, c.max_len, c.dropout, c.word_dropout),
                      [DecoderLayer(**layer_args) for _ in range(c.num_decoder_layers)], final_norm())
    rotary = RotaryEmbedding(c.d_model // c.num_heads, c.max_len) if c.positional == "rope" else None
    slopes = alibi_slopes(c.num_heads) if c.positional == "alibi" else None
    model = Transformer(encoder, decoder, output_proj, pad_id, rotary, slopes)
    _init_weights(model, c.d_model, pad_id)
    if c.share_embeddings != "none":
        output_proj.weight = tgt_emb.weight  # §3.4: one matrix for target embedding and pre-softmax projection
    return model


@torch.no_grad()
def _init_weights(model: Transformer, d_model: int, pad_id: int) -> None:
    """Xavier-uniform projections, zero biases, N(0, d_model^-0.5) embeddings (unit variance after the
    sqrt(d_model) scale, and well-scaled logits when tied)."""
    if any(p.is_meta for p in model.parameters()):
        return
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.output_proj:
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=d_model ** -0.5)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
    nn.init.normal_(model.output_proj.weight, std=d_model ** -0.5)
    for stack in (model.encoder, model.decoder):
        if stack.embed.learned is not None:
            nn.init.normal_(stack.embed.learned.weight, std=math.sqrt(0.5))
