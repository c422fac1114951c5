"""On a GPU: greedy decoding as one CUDA graph a step, replayed over a preallocated key/value cache.

A decoding step of base runs about 220 small kernels (projections, norms, attention over a few dozen
keys, the output product, argmax and bookkeeping). On an H100 or H200 the GPU computes one in under a
millisecond, while the host takes 4-5 ms to launch them: the GPU is busy less than a fifth of the time
(benchmarks/README.md, "Second lease" and "Third lease"). A CUDA graph records a step's kernels once
and launches them all as one.

A graph replays fixed shapes and addresses, so the step here differs from ``decoding.greedy_or_sample``
in three ways, none of which changes a result (tests/test_graphs.py compares the two):

- each decoder layer keeps its keys and values in a buffer as long as the longest output
  (``StaticKVCache``); the step writes its slot at a position held in a tensor, and attends to the
  whole buffer with a mask over the slots not yet written;
- finished sentences stay in the batch (emitting EOS, scored nothing) instead of leaving it;
- the host asks whether every sentence has finished only every ``CHECK_EVERY`` steps.

The step itself is the model's own: its embedding, ``DecoderLayer`` modules, final norm and output
projection, called with the cache above. ``applies`` says when this path is taken: plain greedy search
(no sampling, prefix, n-gram ban or alignment) with sinusoidal or learned positions, on a CUDA device,
with the piece on (``accelerate`` sets it for CUDA in mode auto; ``--accel-skip graphs`` leaves it out).
Elsewhere, and on a CPU, decoding takes the plain loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor

from tformer_cli.tokenizer import BOS_ID, EOS_ID

CHECK_EVERY = 4  # steps between the host's reads of "has every sentence finished?"

_enabled = False


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def supports(model: torch.nn.Module) -> bool:
    """Whether a model's decoder can step at a position held in a tensor: positions added to the
    embeddings (sinusoidal or learned), not inside attention (rotary, ALiBi), and in eval mode."""
    embed = model.decoder.embed
    return (not model.training and model.rotary is None and model.slopes is None
            and (embed.table is not None or embed.learned is not None))


def applies(models: list[torch.nn.Module], src: Tensor, sample: bool, plain: bool) -> bool:
    """Whether greedy decoding of ``src`` runs as CUDA graphs: on, on a GPU, greedy (not ``sample``),
    with no per-step rule beyond min_len (``plain``), every model supported."""
    return _enabled and src.is_cuda and not sample and plain and all(supports(m) for m in models)


class StaticKVCache:
    """One layer's self-attention keys and values in fixed (B, H, capacity, d_k) buffers, written at
    ``position`` (a (1,) tensor shared by the layers); ``append`` returns the whole buffers. The slots
    past ``position`` hold zeros (or an earlier step's values), masked out by the step."""

    def __init__(self, capacity: int, position: Tensor, dtype_for: Callable[[Tensor], torch.dtype]) -> None:
        self.capacity = capacity
        self.position = position
        self.dtype_for = dtype_for
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one step's (B, H, 1, d_k) keys and values; return all (B, H, capacity, d_k) slots."""
        if self.k is None:  # made by the first, eager step, before a graph is recorded
            B, H, _, d_k = k.shape
            self.k = k.new_zeros(B, H, self.capacity, d_k, dtype=self.dtype_for(k))
            self.v = torch.zeros_like(self.k)
        self.k.index_copy_(2, self.position, k.to(self.k.dtype))
        self.v.index_copy_(2, self.position, v.to(self.v.dtype))
        return self.k, self.v


class StaticLayerCache:
    """What ``DecoderLayer`` reads from a cache: ``self_kv`` and the cross-attention ``memory_kv``."""

    def __init__(self, layer: torch.nn.Module, memory: Tensor, capacity: int, position: Tensor) -> None:
        dtype_for = layer.self_attn.attention.cache_dtype
        self.self_kv = StaticKVCache(capacity, position, dtype_for)
        self.memory_kv = tuple(t.to(dtype_for(t)).contiguous() for t in layer.cross_attn.project_memory(memory))


class GreedyState:
    """The tensors one greedy step reads and writes in place, for B sentences and at most L steps."""

    def __init__(self, limits: Tensor) -> None:
        B, L, device = limits.shape[0], int(limits.max()), limits.device
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the step's index
        self.last = torch.full((B, 1), BOS_ID, dtype=torch.long, device=device)  # the newest tokens
        self.out = torch.full((B, L), EOS_ID, dtype=torch.long, device=device)
        self.scores = torch.zeros(B, device=device)
        self.lengths = limits.clone()
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.limits = limits
        self.slots = torch.arange(L, device=device)  # cache slots, for the mask of those written


def _log_probs(model: torch.nn.Module, memory_mask: Tensor | None, caches: list[StaticLayerCache],
               state: GreedyState) -> Tensor:
    """(B, V) log-probabilities of the next token: the model's decoder over the newest tokens at
    ``state.position``, attending to the cache slots written so far and to the sources (``memory_mask``:
    None where no source has padding)."""
    embed = model.decoder.embed
    table = embed.table if embed.table is not None else embed.learned.weight
    x = embed.embedding(state.last) * embed.scale + table.index_select(0, state.position)  # (B, 1, d_model)
    self_mask = (state.slots <= state.position)[None, None, None, :]  # (1, 1, 1, L)
    for layer, cache in zip(model.decoder.layers, caches):
        x, _, _ = layer(x, None, self_mask, memory_mask, is_causal=False, cache=cache)
    return model.logits(model.decoder.final_norm(x)[:, -1]).float().log_softmax(dim=-1)


def _step(models, memory_masks, caches, state: GreedyState, min_len: int) -> None:
    """One greedy step for every sentence, in place: the argmax token, its score, and whether the
    sentence has finished (EOS, or its length limit); finished sentences emit EOS and score nothing."""
    per_model = [_log_probs(m, mask, c, state) for m, mask, c in zip(models, memory_masks, caches)]
    if len(per_model) > 1:  # an ensemble: the average of the models' probabilities
        log_probs = torch.logsumexp(torch.stack(per_model), dim=0) - math.log(len(per_model))
    else:
        log_probs = per_model[0]
    if min_len:
        log_probs[:, EOS_ID] = log_probs[:, EOS_ID].masked_fill(state.position < min_len, float("-inf"))
    token = log_probs.argmax(dim=-1).masked_fill(state.finished, EOS_ID)  # (B,)
    state.scores += log_probs.gather(1, token[:, None]).squeeze(1).masked_fill(state.finished, 0.0)
    state.out.index_copy_(1, state.position, token[:, None])
    ended = (token == EOS_ID) & ~state.finished
    state.lengths.copy_(torch.where(ended, state.position, state.lengths))
    state.finished |= ended | (state.position + 1 >= state.limits)
    state.last.copy_(token[:, None])
    state.position += 1


@torch.inference_mode()
def greedy(models: list[torch.nn.Module], encoded: list, limits: Tensor, min_len: int = 0,
           capture: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy search over encoded sources; ``limits`` (B,) caps each output's length. Returns the
    tokens (B, L) (EOS-padded), the lengths (B,) and the scores (B,), as ``greedy_or_sample`` keeps
    them. The first step runs eagerly (it makes the cache buffers and warms the kernels up); the
    others replay a CUDA graph of the step, or run eagerly too without ``capture`` (a CPU test)."""
    state = GreedyState(limits)
    L = state.out.shape[1]
    caches = [[StaticLayerCache(layer, e.memory, L, state.position) for layer in m.decoder.layers]
              for m, e in zip(models, encoded)]
    memory_masks = [None if bool(e.mask.all()) else e.mask for e in encoded]
    step = lambda: _step(models, memory_masks, caches, state, min_len)  # noqa: E731
    # under autocast, casts are recorded in the graph, not taken from autocast's cache (freed on its exit)
    amp = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False) \
        if capture and torch.is_autocast_enabled("cuda") else nullcontext()
    with amp:
        if capture:  # warm up on a side stream, as CUDA graphs want
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # recorded, not run: the state stays that after step 0
                step()
            step = graph.replay
        else:
            step()
        for t in range(1, L):
            if t % CHECK_EVERY == 0 and bool(state.finished.all()):
                break
            step()
    return state.out, state.lengths, state.scores
