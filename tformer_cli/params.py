"""Parameter counts in closed form and from an instantiated model, FLOPs and memory estimates.

The model is built on the ``meta`` device, so counting a d_model 8192 network allocates nothing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tformer_cli.config import ModelConfig
from tformer_cli.errors import ConfigError, first_line, out_of_memory


@dataclass
class ParamRow:
    component: str
    per_layer: int  # closed-form count for one instance
    layers: int  # how many instances
    formula: int  # per_layer * layers
    model: int  # counted from the built model
    pattern: str  # parameter names belonging to this row (regex)

    @property
    def agrees(self) -> bool:
        return self.formula == self.model


def attention_params(d: int, bias: bool = False) -> int:
    """W_Q, W_K, W_V, W_O (d x d each), and their biases with ``bias``."""
    return 4 * d * d + (4 * d if bias else 0)


def ffn_params(d: int, d_ff: int) -> int:
    return 2 * d * d_ff + d_ff + d


def norm_params(d: int) -> int:
    return 2 * d


def embedding_rows(c: ModelConfig, src_vocab: int, tgt_vocab: int) -> list[tuple[str, int, int, str]]:
    d = c.d_model
    if c.share_embeddings == "all":
        shared = r"(encoder|decoder)\.embed\.embedding|output_proj"
        rows = [("embeddings (src = tgt = output)", src_vocab * d, 1, shared)]
    elif c.share_embeddings == "decoder":
        rows = [("source embedding", src_vocab * d, 1, r"encoder\.embed\.embedding"),
                ("target embedding = output projection", tgt_vocab * d, 1, r"decoder\.embed\.embedding|output_proj")]
    else:
        rows = [("source embedding", src_vocab * d, 1, r"encoder\.embed\.embedding"),
                ("target embedding", tgt_vocab * d, 1, r"decoder\.embed\.embedding"),
                ("output projection", tgt_vocab * d, 1, r"output_proj")]
    if c.positional == "learned":
        rows.append(("learned positions (encoder + decoder)", c.max_len * d, 2, r"(encoder|decoder)\.embed\.learned"))
    return rows


def parameter_rows(c: ModelConfig, src_vocab: int, tgt_vocab: int | None = None) -> list[ParamRow]:
    """One row per component, each counted by formula and from a model built on the meta device."""
    import torch

    from tformer_cli.model import build_model

    tgt_vocab = tgt_vocab or src_vocab
    d, n_enc, n_dec = c.d_model, c.num_encoder_layers, c.num_decoder_layers
    attention = attention_params(d, c.attention_bias)
    spec = embedding_rows(c, src_vocab, tgt_vocab) + [
        ("encoder self-attention", attention, n_enc, r"encoder\.layers\.\d+\.self_attn"),
        ("encoder FFN", ffn_params(d, c.d_ff), n_enc, r"encoder\.layers\.\d+\.ffn"),
        ("encoder LayerNorms", 2 * norm_params(d), n_enc, r"encoder\.layers\.\d+\.norm"),
        ("decoder masked self-attention", attention, n_dec, r"decoder\.layers\.\d+\.self_attn"),
        ("decoder cross-attention", attention, n_dec, r"decoder\.layers\.\d+\.cross_attn"),
        ("decoder FFN", ffn_params(d, c.d_ff), n_dec, r"decoder\.layers\.\d+\.ffn"),
        ("decoder LayerNorms", 3 * norm_params(d), n_dec, r"decoder\.layers\.\d+\.norm"),
    ]
    if c.norm == "pre":
        spec.append(("final LayerNorms (pre-LN)", norm_params(d), 2, r"(encoder|decoder)\.final_norm"))
    try:
        with torch.device("meta"):
            model = build_model(c, src_vocab, tgt_vocab)
    except RuntimeError as exc:
        if not out_of_memory(exc):  # as torch sees a weight of 2^63 bytes or more, even on the meta device
            raise
        raise ConfigError(f"the model is too large for torch to build ({first_line(exc)}); lower model.d_model, "
                          "model.d_ff or data.vocab_size") from None
    named = list(model.named_parameters())  # tied weights appear once
    rows = []
    for name, per_layer, layers, pattern in spec:
        counted = sum(p.numel() for n, p in named if re.match(pattern, n))
        rows.append(ParamRow(name, per_layer, layers, per_layer * layers, counted, pattern))
    return rows


def total_params(c: ModelConfig, src_vocab: int, tgt_vocab: int | None = None) -> int:
    """Closed-form total parameter count."""
    tgt_vocab = tgt_vocab or src_vocab
    d = c.d_model
    attention, ffn = attention_params(d, c.attention_bias), ffn_params(d, c.d_ff)
    total = sum(per * n for _, per, n, _ in embedding_rows(c, src_vocab, tgt_vocab))
    total += c.num_encoder_layers * (attention + ffn + 2 * norm_params(d))
    total += c.num_decoder_layers * (2 * attention + ffn + 3 * norm_params(d))
    if c.norm == "pre":
        total += 2 * norm_params(d)
    return total


def paper_layer_params(c: ModelConfig) -> int:
    """The paper's rule of thumb for one encoder layer: 4 d^2 + 2 d d_ff (weights only)."""
    return 4 * c.d_model ** 2 + 2 * c.d_model * c.d_ff


def matmul_params(c: ModelConfig, tgt_vocab: int) -> tuple[int, int]:
    """Weights that multiply each (source, target) token in matrix products; lookups excluded. The
    decoder's cross-attention projects the encoder's output, so its keys and values count per source token."""
    d, ffn = c.d_model, 2 * c.d_model * c.d_ff
    source = c.num_encoder_layers * (4 * d * d + ffn) + c.num_decoder_layers * 2 * d * d
    target = c.num_decoder_layers * (6 * d * d + ffn) + d * tgt_vocab
    return source, target


def train_flops_per_token(c: ModelConfig, tgt_vocab: int, src_per_tgt: float = 1.0) -> float:
    """Training FLOPs per target token: 6 x matmul weights (forward 2, backward 4), with
    ``src_per_tgt`` source tokens per target token; attention scores are not counted."""
    source, target = matmul_params(c, tgt_vocab)
    return 6.0 * (source * src_per_tgt + target)


TRAINING_BYTES_PER_PARAMETER = 16  # fp32 weights, gradients and Adam's two moments


def table_bytes(c: ModelConfig) -> int:
    """Bytes of the positional tables a model holds beside its parameters, at their peak while built:
    sinusoidal's (max_len, d_model) float32 table a stack, the second built while the first is kept, in
    float64 from float64 angles and their sines (half the channels each); rope's angles, cosines and
    sines, (max_len, d_k / 2) float32 each. Learned positions are parameters; ALiBi's slopes, a row a head."""
    if c.positional == "sinusoidal":
        return (4 + 8 + 4 + 4) * c.max_len * c.d_model
    if c.positional == "rope":
        return 3 * 4 * c.max_len * (c.d_model // c.num_heads // 2)
    return 0


def summary(c: ModelConfig, src_vocab: int, tgt_vocab: int | None = None) -> dict:
    """Everything `count-params` shows, as plain data."""
    tgt_vocab = tgt_vocab or src_vocab
    rows = parameter_rows(c, src_vocab, tgt_vocab)
    total = sum(r.model for r in rows)
    encoder = sum(r.model for r in rows if r.component.startswith("encoder"))
    decoder = sum(r.model for r in rows if r.component.startswith("decoder"))
    return {
        "config": {**asdict(c), "src_vocab_size": src_vocab, "tgt_vocab_size": tgt_vocab},
        "rows": [{k: v for k, v in asdict(r).items() if k != "pattern"} | {"agrees": r.agrees} for r in rows],
        "totals": {"encoder": encoder, "decoder": decoder, "embeddings": total - encoder - decoder,
                   "model": total, "formula": total_params(c, src_vocab, tgt_vocab)},
        "paper_layer_params": paper_layer_params(c),
        "train_flops_per_token": train_flops_per_token(c, tgt_vocab),
        "memory_bytes": {
            "weights_fp32": 4 * total, "weights_bf16": 2 * total,
            "adam_training_fp32": TRAINING_BYTES_PER_PARAMETER * total,
            # bf16 weights and gradients, fp32 Adam moments: 12 bytes a parameter
            "adam_training_bf16": 12 * total,
            "positional_tables": table_bytes(c),  # beside the weights, at their peak while built
        },
    }
