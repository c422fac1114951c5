"""Attention maps of one example: every layer and head of encoder self-attention, decoder masked
self-attention and encoder-decoder cross-attention, with the subword tokens that label them.

Query positions are rows and keys are columns. Decoder positions are labelled by the token they
read (<s> y_1 ... y_m) in decoder self-attention, and by the token they predict (y_1 ... </s>)
in cross-attention, so a cross-attention row shows where the model looked to produce that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tformer_cli.decoding import DecodeOptions, greedy_or_sample
from tformer_cli.errors import UsageError
from tformer_cli.tokenizer import BOS_ID, EOS_ID, Vocabulary

KINDS = ("cross", "encoder", "decoder")


@dataclass
class AttentionCapture:
    source_tokens: list[str]  # x_1 ... x_n </s>
    decoder_inputs: list[str]  # <s> y_1 ... y_m
    decoder_outputs: list[str]  # y_1 ... y_m </s>
    target_text: str
    encoder: Tensor  # (L, H, S, S)
    decoder: Tensor  # (L, H, T, T)
    cross: Tensor  # (L, H, T, S)

    def labels(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of one kind of map."""
        return {"encoder": (self.source_tokens, self.source_tokens),
                "decoder": (self.decoder_inputs, self.decoder_inputs),
                "cross": (self.decoder_outputs, self.source_tokens)}[kind]


@dataclass
class AttentionMap:
    title: str
    layer: int  # 1-based
    head: int | str  # 1-based, or "mean"
    weights: Tensor  # (rows, columns)
    rows: list[str]
    columns: list[str]


@torch.inference_mode()
def capture_attention(model: torch.nn.Module, vocab: Vocabulary, source: str, target: str | None = None,
                      max_new_tokens: int | None = None) -> AttentionCapture:
    """Run one example teacher-forced on ``target`` (or on the model's own greedy output) and keep
    the attention weights of every layer and head."""
    if not source.strip():
        raise UsageError("the source text is empty; pass the sentence to inspect")
    max_len = model.encoder.embed.max_len
    src_ids = vocab.encode_sources([source])[0]
    if len(src_ids) > max_len:
        raise UsageError(f"the source has {len(src_ids)} tokens, more than the model's {max_len} positions; inspect "
                         "a shorter sentence")
    src = torch.tensor([src_ids], device=_device(model))
    if target is None:
        limit = max_new_tokens or max_len - 1
        hypothesis = greedy_or_sample(model, src, DecodeOptions(max_len_a=0, max_len_b=limit))[0]
        tgt_ids = [BOS_ID] + hypothesis.tokens + [EOS_ID]
        target = vocab.decode_targets([hypothesis.tokens])[0]
    else:
        tgt_ids = vocab.encode_targets([target])[0]
        if len(tgt_ids) - 1 > max_len:  # the decoder reads all but the closing EOS
            raise UsageError(f"--target needs {len(tgt_ids) - 1} positions, more than the model's {max_len}; "
                             "give a shorter one")
    tgt_in = torch.tensor([tgt_ids[:-1]], device=src.device)
    encoded = model.encode(src, need_weights=True)
    decoded = model.decode(tgt_in, encoded, need_weights=True)
    return AttentionCapture(
        source_tokens=vocab.source_tokens(src_ids), decoder_inputs=vocab.target_tokens(tgt_ids[:-1]),
        decoder_outputs=vocab.target_tokens(tgt_ids[1:]), target_text=target,
        encoder=torch.stack([w[0] for w in encoded.attention]).float().cpu(),
        decoder=torch.stack([w[0] for w in decoded.self_attention]).float().cpu(),
        cross=torch.stack([w[0] for w in decoded.cross_attention]).float().cpu())


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def parse_selector(value: str, name: str, count: int, allow_mean: bool) -> list[int] | str:
    """'all' -> every index, 'mean' -> 'mean', 'N' -> [N - 1] (1-based on the command line)."""
    if value == "all":
        return list(range(count))
    if value == "mean" and allow_mean:
        return "mean"
    if value == "last":
        return [count - 1]
    words = "N, last, all" + (" or mean" if allow_mean else "")
    try:
        index = int(value)
    except ValueError:
        raise UsageError(f"--{name} {value}: expected {words}") from None
    if not 1 <= index <= count:
        raise UsageError(f"--{name} {value}: out of range; the model has {count} {name}s (1..{count})")
    return [index - 1]


def select_maps(capture: AttentionCapture, kind: str, layer: str = "all", head: str = "mean") -> list[AttentionMap]:
    """The maps to show: for each selected layer, each selected head or the mean over heads."""
    if kind not in KINDS:
        raise UsageError(f"--kind {kind}: expected one of {', '.join(KINDS)}")
    weights = getattr(capture, kind)  # (L, H, rows, columns)
    layers = parse_selector(layer, "layer", weights.shape[0], allow_mean=False)
    heads = parse_selector(head, "head", weights.shape[1], allow_mean=True)
    rows, columns = capture.labels(kind)
    maps = []
    for l in layers:
        if heads == "mean":
            maps.append(AttentionMap(f"{kind} layer {l + 1}, mean of heads", l + 1, "mean", weights[l].mean(0),
                                     rows, columns))
        else:
            maps += [AttentionMap(f"{kind} layer {l + 1}, head {h + 1}", l + 1, h + 1, weights[l, h], rows, columns)
                     for h in heads]
    return maps


def maps_to_json(capture: AttentionCapture, kind: str, maps: list[AttentionMap]) -> dict:
    rows, columns = capture.labels(kind)
    return {"kind": kind, "source_tokens": capture.source_tokens, "target": capture.target_text,
            "row_tokens": rows, "column_tokens": columns,
            "maps": [{"layer": m.layer, "head": m.head, "weights": m.weights.tolist()} for m in maps]}
