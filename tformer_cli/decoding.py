"""Decoding outside the network, over ``model.encode`` / ``model.decode`` with a key/value cache.

The encoder runs once per batch; each step feeds only the newest token, computes logits at that
position only, and drops finished sentences from the batch (and from the cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from tformer_cli.config import DecodeConfig
from tformer_cli.tokenizer import BOS_ID, EOS_ID, Vocabulary


@dataclass
class DecodeOptions:
    beam_size: int = 1
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    length_penalty: float = 0.6  # GNMT alpha: score / ((5 + length) / 6) ** alpha
    max_len_a: float = 1.2  # at most a * source_length + b new tokens
    max_len_b: int = 10
    min_length: int = 0  # EOS is forbidden before this many tokens
    nbest: int = 1

    @classmethod
    def from_config(cls, decode: "DecodeConfig", **overrides) -> "DecodeOptions":
        """The config's decode section (the settings both have), with the given (non-None) values
        taking precedence."""
        values = {f.name: getattr(decode, f.name) for f in dataclasses.fields(cls) if hasattr(decode, f.name)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        options = cls(**values)
        if options.nbest > options.beam_size and not options.sample:
            options.beam_size = options.nbest  # n-best lists need at least n beams
        return options


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # sum of token log-probabilities (EOS included when emitted)
    normalized: float  # score after the length penalty (equal to score for greedy and sampling)


def max_new_tokens(src: Tensor, pad_id: int, options: DecodeOptions, model_max_len: int) -> Tensor:
    """(B,) output length limits: a * source_length + b, within the model's positions."""
    src_len = (src != pad_id).sum(dim=1).float()
    limit = (options.max_len_a * src_len + options.max_len_b).long()
    return limit.clamp(min=1, max=model_max_len - 1)


def _step_log_probs(model: torch.nn.Module, last: Tensor, encoded, cache) -> Tensor:
    """Log-probabilities (b, V) of the next token, from the newest token (b, 1) and the cache."""
    hidden = model.decode(last, encoded, cache).hidden[:, -1]  # (b, d_model)
    return model.logits(hidden).float().log_softmax(dim=-1)


@torch.inference_mode()
def greedy_or_sample(model: torch.nn.Module, src: Tensor, options: DecodeOptions) -> list[Hypothesis]:
    """Greedy search, or sampling with temperature / top-k / top-p when ``options.sample``."""
    B, device = src.shape[0], src.device
    limits = max_new_tokens(src, model.pad_id, options, model.decoder.embed.max_len)
    encoded = model.encode(src)
    cache = model.start_cache(encoded, capacity=int(limits.max()) + 1)
    generator = _generator(options, device)
    out = torch.full((B, int(limits.max())), EOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros(B, device=device)
    lengths = limits.clone()
    alive = torch.arange(B, device=device)  # original row of each row still decoding
    last = torch.full((B, 1), BOS_ID, dtype=torch.long, device=device)
    for t in range(int(limits.max())):
        log_probs = _step_log_probs(model, last, encoded, cache)  # (b, V)
        if t < options.min_length:
            log_probs[:, EOS_ID] = float("-inf")
        if options.sample and options.temperature > 0:
            token = _sample(log_probs, options, generator)  # (b,)
        else:
            token = argmax(log_probs)
        out[alive, t] = token
        scores[alive] += log_probs.gather(1, token[:, None]).squeeze(1)
        done = (token == EOS_ID) | (t + 1 >= limits[alive])
        lengths[alive[token == EOS_ID]] = t
        if done.all():
            break
        if done.any():  # drop finished sentences: they cost no more work
            keep = (~done).nonzero().squeeze(1)
            alive, token = alive[keep], token[keep]
            cache.select(keep)
        last = token[:, None]
    out, lengths, scores = out.tolist(), lengths.tolist(), scores.tolist()
    return [Hypothesis(row[:n], s, s) for row, n, s in zip(out, lengths, scores)]


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(-1)`` for a (b, V) tensor: the first index of each row's maximum. On a CPU torch's
    argmax walks a row one element at a time while ``amax`` is vectorised, so this takes the maximum
    of each block of up to 64 columns, the first block holding the row's maximum, and the argmax inside
    that block only (timings: benchmarks/README.md, "Small measurements")."""
    b, V = x.shape
    block = min(64, V & -V)  # the largest power of two <= 64 dividing V
    if x.device.type != "cpu" or block < 8:
        return x.argmax(dim=-1)
    blocks = x.reshape(b, V // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # (b,)
    return first * block + blocks[torch.arange(b, device=x.device), first].argmax(dim=-1)


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` for a (b, N) tensor (values, then indices, largest first). On a CPU torch's
    topk scans every element; the k largest lie in the k blocks of 64 columns with the largest maxima,
    and block maxima are vectorised, so this ranks the blocks and runs topk only inside the best k
    (timings: benchmarks/README.md, "Small measurements")."""
    b, N = x.shape
    block = min(64, N & -N)  # the largest power of two <= 64 dividing N
    if x.device.type != "cpu" or block < 8 or N // block <= k:
        return x.topk(k, dim=-1)
    best = x.view(b, N // block, block).amax(dim=-1).topk(k, dim=-1).indices  # (b, k) blocks
    columns = (best[:, :, None] * block + torch.arange(block, device=x.device)).view(b, k * block)
    values, inner = x.gather(1, columns).topk(k, dim=-1)  # (b, k) each
    return values, columns.gather(1, inner)


def _generator(options: DecodeOptions, device: torch.device) -> torch.Generator | None:
    if options.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(options.seed)


def _sample(log_probs: Tensor, options: DecodeOptions, generator: torch.Generator | None) -> Tensor:
    """One token per row from softmax(logits / T), restricted to the top-k and the top-p nucleus."""
    logits = log_probs / options.temperature  # (b, V)
    if options.top_k > 0:
        kth = logits.topk(min(options.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative - sorted_logits.softmax(dim=-1) >= options.top_p  # keep the token crossing p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


def _length_penalty(length: int | Tensor, alpha: float):
    return ((5 + length) / 6) ** alpha


@torch.inference_mode()
def beam_search(model: torch.nn.Module, src: Tensor, options: DecodeOptions) -> list[list[Hypothesis]]:
    """Beam search batched over sentences and beams, with GNMT length normalisation.

    A sentence stops when its best finished hypothesis beats the best score any live beam could
    still reach; finished sentences leave the batch. Returns ``nbest`` hypotheses per sentence.
    """
    B, K, device = src.shape[0], options.beam_size, src.device
    alpha = options.length_penalty
    limits = max_new_tokens(src, model.pad_id, options, model.decoder.embed.max_len).tolist()
    encoded = model.encode(src)  # (B, S, d): the K beams of a sentence share its cross-attention K/V
    cache = model.start_cache(encoded, capacity=max(limits) + 1, group=K)
    scores = torch.zeros(B, K, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    history = torch.empty(B * K, 0, dtype=torch.long, device=device)
    last = torch.full((B * K, 1), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    alive = list(range(B))  # original sentence of each block of K rows
    for t in range(max(limits)):
        n = len(alive)
        log_probs = _step_log_probs(model, last, encoded, cache)  # (n*K, V)
        if t < options.min_length:
            log_probs[:, EOS_ID] = float("-inf")
        V = log_probs.shape[-1]
        candidates = log_probs.add_(scores.view(n * K, 1)).view(n, K * V)  # in place: log_probs is not needed after
        top_scores, top_index = topk(candidates, 2 * K)  # (n, 2K): at most K of them end in EOS
        top_beam, top_token = top_index // V, top_index % V
        is_eos = top_token == EOS_ID
        for row, col in (is_eos[:, :K]).nonzero().tolist():  # EOS among the K best: a finished hypothesis
            beam = row * K + top_beam[row, col].item()
            score = top_scores[row, col].item()
            normalized = score / _length_penalty(t + 1, alpha)
            finished[alive[row]].append(Hypothesis(history[beam].tolist(), score, normalized))
        live_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(K, dim=-1)  # (n, K)
        origin = (top_beam.gather(1, pick) + torch.arange(n, device=device)[:, None] * K).view(-1)  # (n*K,)
        token = top_token.gather(1, pick).view(-1)
        history = torch.cat([history[origin], token[:, None]], dim=1)
        scores, last = live_scores, token[:, None]
        cache.reorder(origin)  # beams move within their sentence: cross-attention K/V stay put
        done = _sentences_done(finished, alive, live_scores, history, t + 1, limits, options)
        if all(done):
            break
        if any(done):
            keep_rows = [i for i, d in enumerate(done) if not d]
            rows = torch.tensor([r * K + k for r in keep_rows for k in range(K)], device=device)
            alive = [alive[r] for r in keep_rows]
            scores, history, last = scores[keep_rows], history[rows], last[rows]
            cache.select(rows)
    return [sorted(hyps, key=lambda h: -h.normalized)[: options.nbest] for hyps in finished]


def _sentences_done(finished: list[list[Hypothesis]], alive: list[int], live_scores: Tensor, history: Tensor,
                    length: int, limits: list[int], options: DecodeOptions) -> list[bool]:
    """Per alive sentence: finished hypotheses can no longer be beaten, or the length limit is hit.

    With alpha >= 0, a live beam's best reachable normalised score is its current score (scores only
    fall) divided by the largest penalty it can still get, at its length limit.
    """
    done = []
    K = live_scores.shape[1]
    best_live = live_scores[:, 0].tolist()
    for row, sentence in enumerate(alive):
        hyps = finished[sentence]
        if length >= limits[sentence]:
            missing = options.nbest - len(hyps)  # out of length: the best live beams end here, without EOS
            for k, score in enumerate(live_scores[row, :max(missing, 0)].tolist()):
                hyps.append(Hypothesis(history[row * K + k].tolist(), score,
                                       score / _length_penalty(length, options.length_penalty)))
            done.append(True)
            continue
        bound = best_live[row] / _length_penalty(limits[sentence], options.length_penalty)
        enough = len(hyps) >= options.nbest
        done.append(enough and max(h.normalized for h in hyps) >= bound)
    return done


def decode_batch(model: torch.nn.Module, src: Tensor, options: DecodeOptions) -> list[list[Hypothesis]]:
    """Hypotheses for each source row: beam search when beam_size > 1, else greedy or sampling."""
    if options.beam_size > 1 and not options.sample:
        return beam_search(model, src, options)
    if options.sample and options.nbest > 1:  # n independent samples per source, best first
        rows = torch.arange(src.shape[0], device=src.device).repeat_interleave(options.nbest)
        samples = greedy_or_sample(model, src[rows], options)
        groups = [samples[i:i + options.nbest] for i in range(0, len(samples), options.nbest)]
        return [sorted(group, key=lambda h: -h.score) for group in groups]
    return [[h] for h in greedy_or_sample(model, src, options)]


@dataclass
class Translation:
    source: str
    outputs: list[tuple[str, Hypothesis]]  # best first; text and hypothesis
    truncated: bool = False  # the source was longer than the model's positions


# Hypotheses (sentences x beams, or x samples) decoded together by default. More rows per step make its
# matrix products cheaper per row, until beam search's rows outgrow the packed products (linear.MAX_ROWS)
# and the kernels oneDNN builds per row count (benchmarks/README.md, "Small measurements").
HYPOTHESES_PER_BATCH = 256


def default_batch_size(options: DecodeOptions) -> int:
    """Sentences per batch when decode.batch_size is not set: HYPOTHESES_PER_BATCH rows a step."""
    width = options.nbest if options.sample else options.beam_size
    return max(1, HYPOTHESES_PER_BATCH // width)


def translate(model: torch.nn.Module, vocab: Vocabulary, texts: list[str], options: DecodeOptions,
              batch_size: int | None = None, device: torch.device | str = "cpu") -> list[Translation]:
    """Translate texts in length-sorted batches of ``batch_size`` sentences (default: see
    ``default_batch_size``); results come back in input order.

    Empty texts give an empty output without running the model; sources longer than the model's
    positions are truncated (keeping the closing EOS) and flagged.
    """
    from tformer_cli.data import pad_sequences

    max_len = model.encoder.embed.max_len
    ids = vocab.encode_sources(texts)
    results = [Translation(text, [("", Hypothesis([], 0.0, 0.0))], len(s) > max_len) for text, s in zip(texts, ids)]
    ids = [s[: max_len - 1] + s[-1:] if len(s) > max_len else s for s in ids]
    order = sorted((i for i, text in enumerate(texts) if text.strip()), key=lambda i: len(ids[i]))
    batch_size = batch_size or default_batch_size(options)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        src = pad_sequences([ids[i] for i in chunk]).to(device)
        for i, hyps in zip(chunk, decode_batch(model, src, options)):
            results[i].outputs = list(zip(vocab.decode_targets([h.tokens for h in hyps]), hyps))
    return results
