"""On a GPU: greedy and beam search as one CUDA graph a step, replayed over a preallocated key/value cache.

A decoding step of base runs about 220 small kernels (projections, norms, attention over a few dozen
keys, the output product, the choice of tokens and bookkeeping). On an H100 or H200 the GPU computes
one in under a millisecond, while the host takes 4-5 ms to launch them: the GPU is busy less than a
fifth of the time (benchmarks/README.md, "Second lease" and "Third lease"). A CUDA graph records a
step's kernels once and launches them all as one.

A graph replays fixed shapes and addresses, so the steps here differ from ``decoding.greedy_or_sample``
and ``decoding.beam_search`` in three ways, none of which changes a result (tests/test_graphs.py
compares them):

- each decoder layer keeps its keys and values in a buffer as long as the longest output
  (``StaticKVCache``); the step writes its slot at a position held in a tensor, and attends to the
  whole buffer with a mask over the slots not yet written; beams that continue another beam take its
  rows in place;
- finished sentences stay in the batch (greedy: emitting EOS, scored nothing; beam search: their best
  hypothesis frozen) instead of leaving it; beam search keeps each sentence's best finished hypothesis
  on the GPU instead of a list of all of them on the host (so nbest 1 only);
- the host asks whether every sentence has finished only every ``CHECK_EVERY`` steps.

The step itself is the model's own: its embedding, ``DecoderLayer`` modules, final norm and output
projection, called with the cache above and the position as a tensor (``Decoders``: added to the
embeddings, rotated into the queries and keys, or ALiBi's distance bias). ``applies`` says when this path
is taken: greedy or beam search without sampling, prefix, n-gram ban or alignment, on a CUDA device,
with the piece on (``accelerate`` sets it for CUDA in mode auto; ``--accel-skip graphs`` leaves it out).
Elsewhere, and on a CPU, decoding takes the plain loops; so it does, after one warning, where a step
cannot be recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor

from tformer_cli.ensemble import Ensemble, average_log_probs
from tformer_cli.model.attention import RotaryEmbedding, distance_bias, rotate
from tformer_cli.model.transformer import DecoderCache
from tformer_cli.tokenizer import BOS_ID, EOS_ID, NOT_OUTPUTS

CHECK_EVERY = 4  # steps between the host's reads of "has every sentence finished?"

_enabled = False


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def supports(model: torch.nn.Module) -> bool:
    """Whether a model's decoder steps here: in eval mode (every kind of positions steps at a position
    held in a tensor: added to the embeddings, rotated into the queries and keys, or a distance bias)."""
    return not model.training


def applies(models: Ensemble, src: Tensor, options, prefix: Tensor | None = None) -> bool:
    """Whether greedy or beam search over ``src`` with ``options`` (``decoding.DecodeOptions``) runs as
    CUDA graphs: the piece on, ``src`` on a GPU, every model supported, and no rule that the plain
    loops apply per step or hypothesis beyond min_len: no sampling, ``prefix``, n-gram ban, alignment
    or n-best list."""
    plain = (not (options.sample and options.temperature > 0) and prefix is None and not options.no_repeat_ngram
             and options.align_layer is None and options.nbest == 1)
    return _enabled and src.is_cuda and plain and all(supports(m) for m in models.models)


class StaticKVCache:
    """One layer's self-attention keys and values in fixed (rows, H, capacity, d_k) buffers, written at
    ``position`` (a (1,) tensor shared by the layers); ``append`` returns the whole buffers. The slots
    past ``position`` hold zeros (or an earlier step's values), masked out by the step."""

    def __init__(self, capacity: int, position: Tensor, dtype_for: Callable[[Tensor], torch.dtype]) -> None:
        self.capacity = capacity
        self.position = position
        self.dtype_for = dtype_for
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one step's (rows, H, 1, d_k) keys and values; return all (rows, H, capacity, d_k) slots."""
        if self.k is None:  # made by the first, eager step, before a graph is recorded
            rows, H, _, d_k = k.shape
            self.k = k.new_zeros(rows, H, self.capacity, d_k, dtype=self.dtype_for(k))
            self.v = torch.zeros_like(self.k)
        self.k.index_copy_(2, self.position, k.to(self.k.dtype))
        self.v.index_copy_(2, self.position, v.to(self.v.dtype))
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Row i takes row ``index[i]``'s keys and values (beams that continue another beam)."""
        self.k.copy_(self.k.index_select(0, index))
        self.v.copy_(self.v.index_select(0, index))


class Decoders:
    """The models' decoders stepping together over static caches, for ``rows`` rows of ``L`` steps:
    each model's ``DecoderCache`` (cross-attention keys and values, the source mask) with a
    ``StaticKVCache`` for each layer's self-attention."""

    def __init__(self, models: Ensemble, encoded: list, rows: int, L: int) -> None:
        device = encoded[0].memory.device
        self.models = models.models
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the step's index
        self.last = torch.full((rows, 1), BOS_ID, dtype=torch.long, device=device)  # the newest tokens
        self.slots = torch.arange(L, device=device)  # cache slots, for the mask of those written
        self.caches = models.start_cache(encoded, L).caches
        for layer in (layer for cache in self.caches for layer in cache.layers):
            layer.self_kv = StaticKVCache(L, self.position, layer.self_kv.dtype_for)

    def log_probs(self, min_len: int) -> Tensor:
        """(rows, V) log-probabilities of the next token (an ensemble's: the average of the models'
        probabilities), padding and the start symbol forbidden, as the plain loops forbid them
        (``decoding_rules.constrain``), and EOS before ``min_len`` tokens."""
        log_probs = average_log_probs([self._log_probs(m, c) for m, c in zip(self.models, self.caches)])
        log_probs[:, NOT_OUTPUTS] = float("-inf")
        if min_len:
            log_probs[:, EOS_ID] = log_probs[:, EOS_ID].masked_fill(self.position < min_len, float("-inf"))
        return log_probs

    def _log_probs(self, model: torch.nn.Module, cache: DecoderCache) -> Tensor:
        """One model's decoder over the newest tokens at ``position``, attending to the cache slots
        written so far and to the sources: ``model.decode``'s step with the position as a tensor."""
        embed = model.decoder.embed
        x = embed.embedding(self.last) * embed.scale  # (rows, 1, d_model)
        if embed.table is not None or embed.learned is not None:  # sinusoidal or learned positions
            table = embed.table if embed.table is not None else embed.learned.weight
            x = x + table.index_select(0, self.position)
        written = self.slots <= self.position  # (L,)
        if model.slopes is not None:  # ALiBi: the distance bias to the slots written
            bias = distance_bias(model.slopes, self.position[:, None], self.slots[None, :])  # (H, 1, L)
            self_mask = bias.masked_fill(~written, float("-inf"))[None]  # (1, H, 1, L)
        else:
            self_mask = written[None, None, None, :]  # (1, 1, 1, L)
        rotary = _RotaryAt(model.rotary, self.position) if model.rotary is not None else None
        for layer, layer_cache in zip(model.decoder.layers, cache.layers):
            x, _, _ = layer(x, None, self_mask, cache.memory_mask, is_causal=False, cache=layer_cache, rotary=rotary)
        return model.logits(model.decoder.final_norm(x)[:, -1]).float().log_softmax(dim=-1)

    def advance(self, token: Tensor, origin: Tensor | None = None) -> None:
        """Feed ``token`` (rows,) at the next step; with ``origin``, row i continues row ``origin[i]``."""
        if origin is not None:
            for layer in (layer for cache in self.caches for layer in cache.layers):
                layer.self_kv.reorder(origin)
        self.last.copy_(token[:, None])
        self.position += 1


class _RotaryAt:
    """A model's rotary embedding at the position held in a (1,) tensor: its tables read with
    ``index_select`` rather than sliced at a Python int, which a recorded graph would keep fixed."""

    def __init__(self, rotary: RotaryEmbedding, position: Tensor) -> None:
        self.rotary, self.position = rotary, position

    def __call__(self, x: Tensor, position: int = 0) -> Tensor:  # (rows, H, 1, d_k); ``position``: the plain path's
        return rotate(x, self.rotary.cos.index_select(0, self.position), self.rotary.sin.index_select(0, self.position))


class GreedyState:
    """What a greedy step reads and writes in place, for B sentences and at most L steps."""

    def __init__(self, limits: Tensor) -> None:
        B, L, device = limits.shape[0], int(limits.max()), limits.device
        self.out = torch.full((B, L), EOS_ID, dtype=torch.long, device=device)
        self.scores = torch.zeros(B, device=device)
        self.lengths = limits.clone()
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.limits = limits

    def step(self, decoders: Decoders, min_len: int) -> None:
        """One greedy step for every sentence: the argmax token, its score, and whether the sentence
        has finished (EOS, or its length limit); finished sentences emit EOS and score nothing."""
        log_probs, position = decoders.log_probs(min_len), decoders.position
        token = log_probs.argmax(dim=-1).masked_fill(self.finished, EOS_ID)  # (B,)
        self.scores += log_probs.gather(1, token[:, None]).squeeze(1).masked_fill(self.finished, 0.0)
        self.out.index_copy_(1, position, token[:, None])
        ended = (token == EOS_ID) & ~self.finished
        self.lengths.copy_(torch.where(ended, position, self.lengths))
        self.finished |= ended | (position + 1 >= self.limits)
        decoders.advance(token)

    def over(self) -> Tensor:
        return self.finished.all()


class BeamState:
    """What a step of beam search reads and writes in place: K beams of B sentences, and each
    sentence's best finished hypothesis so far (``decoding.beam_search`` with nbest 1: the same
    candidates, scores, GNMT length penalty and stopping rule, without a sentence leaving the batch)."""

    def __init__(self, limits: Tensor, K: int, alpha: float) -> None:
        B, L, device = limits.shape[0], int(limits.max()), limits.device
        self.K, self.alpha, self.limits = K, alpha, limits
        self.scores = torch.zeros(B, K, device=device)
        self.scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
        self.history = torch.full((B * K, L), EOS_ID, dtype=torch.long, device=device)  # each beam's tokens
        self.first_row = torch.arange(B, device=device)[:, None] * K  # (B, 1): a sentence's first beam
        self.best_tokens = torch.full((B, L), EOS_ID, dtype=torch.long, device=device)
        self.best_length = torch.zeros(B, dtype=torch.long, device=device)
        self.best_score = torch.zeros(B, device=device)
        self.best_normalized = torch.full((B,), float("-inf"), dtype=torch.float64, device=device)  # -inf: none yet
        self.active = torch.ones(B, dtype=torch.bool, device=device)  # not yet done (beam_search: in the batch)
        self.limit_penalty = self._penalty(limits)  # (B,): the largest a sentence's beams can reach

    def _penalty(self, length: Tensor) -> Tensor:
        return ((5 + length.double()) / 6) ** self.alpha  # GNMT's, in float64 as the host computes it

    def _keep_best(self, better: Tensor, rows: Tensor, length: Tensor, score: Tensor, normalized: Tensor) -> None:
        """Where ``better`` (B,), a sentence's best hypothesis becomes ``rows``' tokens (as ``history``
        holds them now), of ``length``, ``score`` and ``normalized``."""
        self.best_tokens.copy_(torch.where(better[:, None], self.history.index_select(0, rows), self.best_tokens))
        self.best_length.copy_(torch.where(better, length, self.best_length))
        self.best_score.copy_(torch.where(better, score, self.best_score))
        self.best_normalized.copy_(torch.where(better, normalized, self.best_normalized))

    def step(self, decoders: Decoders, min_len: int) -> None:
        """One step of every sentence's K beams: the 2K best continuations, those ending in EOS among
        the K best finishing hypotheses, the K best of the others continuing; then whether the
        sentence is done."""
        K, position = self.K, decoders.position
        log_probs = decoders.log_probs(min_len)  # (B * K, V)
        B, V = self.scores.shape[0], log_probs.shape[-1]
        candidates = (log_probs + self.scores.view(B * K, 1)).view(B, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=-1)  # (B, 2K): at most K of them end in EOS
        top_beam, top_token = top_index // V, top_index % V
        is_eos = (top_token == EOS_ID) & (top_scores > float("-inf"))
        live_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(K, dim=-1)  # (B, K)
        # EOS among the K best candidates finishes a hypothesis; a sentence keeps its best (the first of equals)
        length = position + 1
        penalty = self._penalty(length)
        normalized = torch.where(is_eos[:, :K], top_scores[:, :K].double() / penalty, float("-inf"))
        best_new, col = normalized.max(dim=-1)  # (B,)
        ending_row = (self.first_row + top_beam.gather(1, col[:, None])).view(-1)
        self._keep_best(self.active & (best_new > self.best_normalized), ending_row, position.expand(B),
                        top_scores.gather(1, col[:, None]).view(-1), best_new)
        # the K best candidates that do not end continue
        origin = (top_beam.gather(1, pick) + self.first_row).view(-1)  # (B * K,)
        token = top_token.gather(1, pick).view(-1)
        self.history.copy_(self.history.index_select(0, origin))
        self.history.index_copy_(1, position, token[:, None])
        self.scores.copy_(live_scores)
        decoders.advance(token, origin)
        # a sentence is done at its length limit (where its best live beam ends, and is its best
        # hypothesis if it scores better), or when no live beam can reach its best normalised score
        at_limit = self.active & (length >= self.limits)
        cut = live_scores[:, 0].double() / penalty
        self._keep_best(at_limit & (cut > self.best_normalized), self.first_row.view(-1), length.expand(B),
                        live_scores[:, 0], cut)
        reachable = live_scores[:, 0].double() / self.limit_penalty  # -inf (no live beam) reaches nothing
        self.active &= ~(at_limit | (self.best_normalized >= reachable))

    def over(self) -> Tensor:
        return ~self.active.any()


def _run(state: GreedyState | BeamState, decoders: Decoders, min_len: int, capture: bool) -> bool:
    """Run ``state``'s steps until every sentence is over or the steps run out: the first eagerly,
    the others as replays of a CUDA graph of the step (or eagerly, without ``capture``). False where
    the step cannot be recorded: the piece is then turned off, after one warning."""
    step = lambda: state.step(decoders, min_len)  # noqa: E731
    # under autocast, casts are recorded in the graph, not taken from autocast's cache (freed on its exit)
    amp = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False) \
        if capture and torch.is_autocast_enabled("cuda") else nullcontext()
    with amp:
        if capture:
            try:
                step = _record(step)
            except RuntimeError as error:  # an op that cannot be recorded on this torch or driver
                enable(False)
                warnings.warn(f"decoding could not be recorded as a CUDA graph ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); it decodes a step at a time",
                              stacklevel=3)
                return False
        else:
            step()
        for t in range(1, decoders.slots.shape[0]):
            if t % CHECK_EVERY == 0 and bool(state.over()):
                break
            step()
    return True


def _record(step: Callable[[], None]) -> Callable[[], None]:
    """Run ``step`` once eagerly on a side stream (warming up, as CUDA graphs want), then record it as
    a graph (recording runs nothing: the state stays that after the first step); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


@torch.inference_mode()
def greedy(models: Ensemble, encoded: list, limits: Tensor, min_len: int = 0,
           capture: bool = True) -> tuple[Tensor, Tensor, Tensor] | None:
    """Greedy search over encoded sources; ``limits`` (B,) caps each output's length. Returns the
    tokens (B, L) (EOS-padded), the lengths (B,) and the scores (B,), as ``greedy_or_sample`` keeps
    them; None where the step could not be recorded (the caller then decodes on the plain path).
    ``capture`` False runs every step eagerly (a CPU test of the step)."""
    state = GreedyState(limits)
    decoders = Decoders(models, encoded, limits.shape[0], state.out.shape[1])
    if not _run(state, decoders, min_len, capture):
        return None
    return state.out, state.lengths, state.scores


@torch.inference_mode()
def beam(models: Ensemble, encoded: list, limits: Tensor, beams: int, alpha: float,
         min_len: int = 0, capture: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """Beam search over encoded sources, ``beams`` beams a sentence, GNMT penalty ``alpha``; ``limits``
    (B,) caps each output's length. Returns each sentence's best hypothesis: its tokens (B, L), length
    (B,), score (B,) and normalised score (B,); None where the step could not be recorded."""
    state = BeamState(limits, beams, alpha)
    decoders = Decoders(models, encoded, limits.shape[0] * beams, state.history.shape[1])
    if not _run(state, decoders, min_len, capture):
        return None
    return state.best_tokens, state.best_length, state.best_score, state.best_normalized
