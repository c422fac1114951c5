"""What decoding searches over: one model, or several that share a vocabulary, decoded as one.

An ensemble runs every model over its own encoder output and key/value cache, and averages their
next-token probabilities at each step (fairseq's ensemble: the log of the mean probability, so the
result is again a distribution to search or sample from). A single model is an ensemble of one,
with no averaging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from tformer_cli.model.transformer import DecoderCache, Encoded


class Ensemble:
    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        self.models = list(models)
        self.pad_id = self.models[0].pad_id
        # the longest sequence every model has positions for
        self.max_len = min(min(m.encoder.embed.max_len, m.decoder.embed.max_len) for m in self.models)

    def encode(self, src: Tensor) -> list[Encoded]:
        return [model.encode(src) for model in self.models]

    def start_cache(self, encoded: list[Encoded], capacity: int, group: int = 1) -> "EnsembleCache":
        return EnsembleCache([model.start_cache(e, capacity, group) for model, e in zip(self.models, encoded)])

    def next_log_probs(self, last: Tensor, encoded: list[Encoded], cache: "EnsembleCache",
                       align_layer: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities (b, V) of the next token, from the newest token (b, 1) and the caches; with
        ``align_layer``, also that decoder layer's cross-attention from the new token, averaged over heads
        (and models): (b, S)."""
        log_probs, attention = [], []
        for model, e, c in zip(self.models, encoded, cache.caches):
            decoded = model.decode(last, e, c, need_weights=align_layer is not None)
            log_probs.append(model.logits(decoded.hidden[:, -1]).float().log_softmax(dim=-1))
            if align_layer is not None:
                attention.append(decoded.cross_attention[align_layer][:, :, -1].float().mean(dim=1))
        return average_log_probs(log_probs), (sum(attention) / len(attention) if attention else None)


def average_log_probs(log_probs: list[Tensor]) -> Tensor:
    """The log of the models' averaged probabilities, from each model's log-probabilities."""
    if len(log_probs) == 1:
        return log_probs[0]
    return torch.logsumexp(torch.stack(log_probs), dim=0) - math.log(len(log_probs))


class EnsembleCache:
    """The models' decoder caches, selected and reordered together (see ``DecoderCache``)."""

    def __init__(self, caches: list[DecoderCache]) -> None:
        self.caches = caches

    def select(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.select(index)

    def reorder(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(index)


def as_ensemble(model: torch.nn.Module | Ensemble) -> Ensemble:
    return model if isinstance(model, Ensemble) else Ensemble([model])
