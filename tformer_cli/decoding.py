"""Decoding outside the network, over ``model.encode`` / ``model.decode`` with a key/value cache.

The encoder runs once per batch; each step feeds only the newest token, computes logits at that
position only, and drops finished sentences from the batch (and from the cache).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tformer_cli.accel import graphs
from tformer_cli.accel.search import argmax, topk
from tformer_cli.config import DecodeConfig
from tformer_cli.decoding_rules import Prefix, constrain, max_new_tokens
from tformer_cli.ensemble import Ensemble, as_ensemble
from tformer_cli.mbr import rank, sentence_metric
from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, Vocabulary


@dataclass
class DecodeOptions:
    beam_size: int = 1
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    epsilon: float | None = None  # sampling: tokens less likely than this are never drawn; None: 0 (MBR: 0.02)
    seed: int | None = None
    length_penalty: float = 0.6  # GNMT alpha: score / ((5 + length) / 6) ** alpha
    max_len_a: float = 1.2  # at most a * source_length + b new tokens
    max_len_b: int = 10
    min_len: int = 0  # EOS is forbidden before this many tokens
    no_repeat_ngram: int = 0  # n > 0: no n-gram occurs twice in an output (fairseq's --no-repeat-ngram-size)
    nbest: int = 1
    align_layer: int | None = None  # a decoder layer's index: output tokens aligned by its cross-attention
    mbr: int = 0  # n > 0: minimum-Bayes-risk choice among n candidates (see ``mbr.py``)
    mbr_metric: str = "chrf"  # chrf | bleu: the utility of a candidate against each other one
    mbr_candidates: str = "sample"  # sample: n samples; beam: the n best of a beam search

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

    def candidates(self) -> "DecodeOptions":
        """The search that gives minimum-Bayes-risk decoding its candidates: ``mbr`` samples, or the
        ``mbr``-best hypotheses of a beam at least that wide. Unless epsilon is set, samples are epsilon
        samples (0.02): on Multi30k that gains 1.9 BLEU over plain sampling at 16 samples
        (docs/results.md), as Freitag et al. (2023) found on WMT."""
        if self.mbr_candidates == "beam":
            return dataclasses.replace(self, sample=False, nbest=self.mbr, beam_size=max(self.beam_size, self.mbr),
                                       mbr=0)
        return dataclasses.replace(self, sample=True, nbest=self.mbr, beam_size=1, mbr=0,
                                   epsilon=MBR_EPSILON if self.epsilon is None else self.epsilon)


MBR_EPSILON = 0.02  # minimum-Bayes-risk's default samples: tokens of probability >= 0.02


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # sum of token log-probabilities (EOS included when emitted)
    normalized: float  # score after the length penalty (equal to score for greedy and sampling)
    alignment: list[int] | None = None  # per output token, the source position it attends to most


def attended_source(attention: Tensor, src: Tensor) -> Tensor:
    """(b,) the real source token (not padding nor EOS) each row's attention (b, S) weighs most."""
    real = (src != PAD_ID) & (src != EOS_ID)
    return attention.masked_fill(~real, -1.0).argmax(dim=-1)


@torch.inference_mode()
def greedy_or_sample(model: torch.nn.Module | Ensemble, src: Tensor, options: DecodeOptions,
                     prefix: Prefix | None = None) -> list[Hypothesis]:
    """Greedy search, or sampling with temperature / top-k / top-p when ``options.sample``, each output
    starting with its row's ``prefix``. On a GPU, plain greedy search replays each step as a CUDA graph
    (``accel.graphs``, the same results)."""
    models = as_ensemble(model)
    limits = max_new_tokens(src, models.pad_id, options, models.max_len, prefix)
    encoded = models.encode(src)
    graphed = None
    if graphs.applies(models, src, options, prefix):
        graphed = graphs.greedy(models, encoded, limits, options.min_len)  # None: it could not record
    if graphed is not None:
        (out, lengths, scores), aligned = graphed, None
    else:
        out, lengths, scores, aligned = _greedy_loop(models, src, encoded, limits, options, prefix)
    out, lengths, scores = out.tolist(), lengths.tolist(), scores.tolist()
    alignments = aligned.tolist() if aligned is not None else [None] * len(out)
    return [Hypothesis(row[:n], s, s, a[:n] if a is not None else None)
            for row, n, s, a in zip(out, lengths, scores, alignments)]


def _greedy_loop(models: Ensemble, src: Tensor, encoded, limits: Tensor, options: DecodeOptions,
                 prefix: Prefix | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Greedy search (or sampling) a step at a time over a growing cache, finished sentences leaving
    the batch. Returns the tokens (B, L), EOS-padded, the lengths (B,), the scores (B,) and, with
    ``options.align_layer``, the source position each token attends to most (B, L)."""
    B, device = src.shape[0], src.device
    cache = models.start_cache(encoded, capacity=int(limits.max()) + 1)
    generator = _generator(options, device)
    out = torch.full((B, int(limits.max())), EOS_ID, dtype=torch.long, device=device)
    aligned = torch.zeros_like(out) if options.align_layer is not None else None
    scores = torch.zeros(B, device=device)
    lengths = limits.clone()
    alive = torch.arange(B, device=device)  # original row of each row still decoding
    last = torch.full((B, 1), BOS_ID, dtype=torch.long, device=device)
    # characters of its prefix each row has written
    written = torch.zeros(B, dtype=torch.long, device=device) if prefix is not None else None
    for t in range(int(limits.max())):
        log_probs, attention = models.next_log_probs(last, encoded, cache, options.align_layer)  # (b, V)
        inside = prefix.inside(alive.tolist(), written[alive]) if prefix is not None else None
        constrain(log_probs, t, options, out[alive, :t] if options.no_repeat_ngram else None, inside)
        if inside is None:
            prefix = None  # every row is past its prefix
        if options.sample and options.temperature > 0:
            token = _sample(log_probs, options, generator)  # (b,)
        else:
            token = argmax(log_probs)
        out[alive, t] = token
        if aligned is not None:
            aligned[alive, t] = attended_source(attention, src[alive])
        scores[alive] += log_probs.gather(1, token[:, None]).squeeze(1)
        if prefix is not None:
            written[alive] += prefix.pieces.chars(token)
        ended = token == EOS_ID
        lengths[alive] = torch.where(ended, t, lengths[alive])
        done = ended | (t + 1 >= limits[alive])
        finishing = int(done.sum())  # the step's one wait for the device
        if finishing == len(alive):
            break
        if finishing:  # drop finished sentences: they cost no more work
            keep = torch.argsort(done.byte(), stable=True)[:len(alive) - finishing]  # the others, in order
            alive, token = alive[keep], token[keep]
            cache.select(keep)
        last = token[:, None]
    return out, lengths, scores, aligned


def _generator(options: DecodeOptions, device: torch.device) -> torch.Generator | None:
    if options.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(options.seed)


def _sample(log_probs: Tensor, options: DecodeOptions, generator: torch.Generator | None) -> Tensor:
    """One token per row from softmax(logits / T), restricted to the top-k, the top-p nucleus and the
    tokens of probability at least epsilon (epsilon sampling, Hewitt et al. 2022; the most likely
    token always stays)."""
    # shifted so that each row's best is 0: a tiny T (even one that is 0 in the logits' precision) sends
    # the others to -inf, never all of them; a huge one (inf in that precision) makes them all 0, never nan
    finfo = torch.finfo(log_probs.dtype)
    temperature = min(max(options.temperature, finfo.tiny), finfo.max)
    logits = (log_probs - log_probs.amax(dim=-1, keepdim=True)) / temperature  # (b, V)
    if options.top_k > 0:
        kth = logits.topk(min(options.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.epsilon:
        unlikely = log_probs < math.log(options.epsilon)
        unlikely.scatter_(1, log_probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(unlikely, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative - sorted_logits.softmax(dim=-1) >= options.top_p  # keep the token crossing p
        outside[:, 0] = False  # and the likeliest, even where p is 0 in the logits' precision
        logits = logits.scatter(1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


def _length_penalty(length: int | Tensor, alpha: float):
    return ((5 + length) / 6) ** alpha


@torch.inference_mode()
def beam_search(model: torch.nn.Module | Ensemble, src: Tensor, options: DecodeOptions,
                prefix: Prefix | None = None) -> list[list[Hypothesis]]:
    """Beam search batched over sentences and beams, with GNMT length normalisation.

    A sentence stops when its nbest-th best finished hypothesis beats the best score any live beam
    could still reach; finished sentences leave the batch. Returns ``nbest`` hypotheses per sentence, each
    starting with its sentence's ``prefix``. On a GPU, with nbest 1, each step is replayed as a CUDA
    graph (``accel.graphs``, the same results).
    """
    models = as_ensemble(model)
    B, K, device = src.shape[0], options.beam_size, src.device
    alpha = options.length_penalty
    limits = max_new_tokens(src, models.pad_id, options, models.max_len, prefix)
    encoded = models.encode(src)  # (B, S, d): the K beams of a sentence share its cross-attention K/V
    if graphs.applies(models, src, options, prefix):  # on a GPU: each step replayed as a CUDA graph
        best = graphs.beam(models, encoded, limits, K, alpha, options.min_len)  # None: it could not record
        if best is not None:
            tokens, lengths, scores, normalized = (t.tolist() for t in best)
            return [[Hypothesis(row[:n], s, z)] for row, n, s, z in zip(tokens, lengths, scores, normalized)]
    limits = limits.tolist()
    cache = models.start_cache(encoded, capacity=max(limits) + 1, group=K)
    beams = _Beams.start(B, K, device, options.align_layer is not None, prefix is not None)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    for t in range(max(limits)):
        n = len(beams.alive)
        log_probs, attention = models.next_log_probs(beams.last, encoded, cache, options.align_layer)  # (n*K, V)
        inside = prefix.inside(beams.sentences(), beams.written) if prefix is not None else None
        constrain(log_probs, t, options, beams.history if options.no_repeat_ngram else None, inside)
        if inside is None:
            prefix = beams.written = None  # every beam is past its prefix
        V = log_probs.shape[-1]
        candidates = log_probs.add_(beams.scores.view(n * K, 1)).view(n, K * V)  # in place: not needed after
        top_scores, top_index = topk(candidates, 2 * K)  # (n, 2K): at most K of them end in EOS
        top_beam, top_token = top_index // V, top_index % V
        is_eos = (top_token == EOS_ID) & (top_scores > float("-inf"))  # -inf: a beam that a prefix left empty
        live_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(K, dim=-1)  # (n, K)
        # what the bookkeeping reads, copied to the host at once: one wait for the device a step
        host = torch.stack([top_scores[:, :K], is_eos[:, :K], top_beam[:, :K], live_scores]).float().cpu()
        beams.finish(finished, [(beams.alive[row], row * K + int(host[2, row, col]), float(host[0, row, col]))
                                for row, col in host[1].nonzero().tolist()], t + 1, alpha)  # EOS among the K best
        origin = (top_beam.gather(1, pick) + torch.arange(n, device=device)[:, None] * K).view(-1)  # (n*K,)
        token = top_token.gather(1, pick).view(-1)
        # a token is aligned by the attention of the step that chose it
        source = (attended_source(attention, src[beams.alive].repeat_interleave(K, dim=0))
                  if beams.aligned is not None else None)
        beams.advance(origin, token, live_scores, source, prefix.pieces.chars(token) if prefix is not None else None)
        cache.reorder(origin)  # beams move within their sentence: cross-attention K/V stay put
        done, ends = _sentences_done(finished, beams.alive, host[3], t + 1, limits, options)
        beams.finish(finished, ends, t + 1, alpha)
        if all(done):
            break
        if any(done):
            cache.select(beams.keep(done))
    return [sorted(hyps, key=lambda h: -h.normalized)[: options.nbest] for hyps in finished]


@dataclass
class _Beams:
    """Beam search's live hypotheses, K rows for each sentence still searched (``alive``: its index in
    the batch): their scores, their tokens (``history``) and the last of them; and where they are
    asked for, each token's most attended source position (``aligned``) and the characters of its
    prefix each row has written (``written``)."""
    alive: list[int]
    scores: Tensor  # (n, K)
    history: Tensor  # (n*K, t)
    last: Tensor  # (n*K, 1)
    aligned: Tensor | None  # (n*K, t)
    written: Tensor | None  # (n*K,)

    @classmethod
    def start(cls, sentences: int, K: int, device: torch.device, aligned: bool, prefixed: bool) -> "_Beams":
        scores = torch.zeros(sentences, K, device=device)
        scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
        history = torch.empty(sentences * K, 0, dtype=torch.long, device=device)
        return cls(list(range(sentences)), scores, history,
                   torch.full((sentences * K, 1), BOS_ID, dtype=torch.long, device=device),
                   history.clone() if aligned else None,
                   torch.zeros(sentences * K, dtype=torch.long, device=device) if prefixed else None)

    def sentences(self) -> list[int]:
        """The sentence of each row."""
        return [sentence for sentence in self.alive for _ in range(self.scores.shape[1])]

    def advance(self, origin: Tensor, token: Tensor, scores: Tensor, source: Tensor | None,
                chars: Tensor | None) -> None:
        """Row i continues row ``origin[i]`` with ``token[i]``, at ``scores`` (n, K); ``source``: the
        source position each old row attended to most; ``chars``: the prefix characters each token writes."""
        self.history = torch.cat([self.history[origin], token[:, None]], dim=1)
        if self.aligned is not None:
            self.aligned = torch.cat([self.aligned[origin], source[origin, None]], dim=1)
        if self.written is not None:
            self.written = self.written[origin] + chars
        self.scores, self.last = scores, token[:, None]

    def finish(self, finished: list[list[Hypothesis]], ends: list[tuple[int, int, float]], length: int,
               alpha: float) -> None:
        """Add to ``finished`` the hypotheses ``ends``, each (sentence, row, score); their tokens are
        copied to the host together."""
        if not ends:
            return
        index = torch.tensor([row for _, row, _ in ends], device=self.history.device)
        tokens = self.history[index].tolist()
        alignments = self.aligned[index].tolist() if self.aligned is not None else [None] * len(ends)
        for (sentence, _, score), row, alignment in zip(ends, tokens, alignments):
            finished[sentence].append(Hypothesis(row, score, score / _length_penalty(length, alpha), alignment))

    def keep(self, done: list[bool]) -> Tensor:
        """Drop the sentences that are ``done``; returns the rows kept, for the cache to keep too."""
        K = self.scores.shape[1]
        keep_rows = [i for i, d in enumerate(done) if not d]
        rows = torch.tensor([r * K + k for r in keep_rows for k in range(K)], device=self.history.device)
        self.alive = [self.alive[r] for r in keep_rows]
        self.scores, self.history, self.last = self.scores[keep_rows], self.history[rows], self.last[rows]
        self.aligned = self.aligned[rows] if self.aligned is not None else None
        self.written = self.written[rows] if self.written is not None else None
        return rows


def _sentences_done(finished: list[list[Hypothesis]], alive: list[int], live_scores: Tensor, length: int,
                    limits: list[int], options: DecodeOptions) -> tuple[list[bool], list[tuple[int, int, float]]]:
    """Per alive sentence: its nbest finished hypotheses can no longer be beaten, or the length limit is hit.

    With alpha >= 0, a live beam's best reachable normalised score is its current score (scores only
    fall) divided by the largest penalty it can still get, at its length limit. ``live_scores`` (n, K)
    is on the host. Also returns the live beams at their sentence's length limit, (sentence, row, score)
    each: they end there without EOS and compete with the finished hypotheses, as in Hugging Face's
    ``generate`` (a hypothesis that ended early with a poor score does not beat a better one cut short).
    """
    done, ends = [], []
    K = live_scores.shape[1]
    live = live_scores.tolist()
    for row, sentence in enumerate(alive):
        hyps = finished[sentence]
        if length >= limits[sentence]:
            ends += [(sentence, row * K + k, score) for k, score in enumerate(live[row]) if score > float("-inf")]
            done.append(True)
            continue
        bound = live[row][0] / _length_penalty(limits[sentence], options.length_penalty)
        enough = len(hyps) >= options.nbest  # and the nbest-th of them beats every live beam
        done.append(enough and sorted(h.normalized for h in hyps)[-options.nbest] >= bound)
    return done, ends


def decode_batch(model: torch.nn.Module | Ensemble, src: Tensor, options: DecodeOptions,
                 prefix: Prefix | None = None) -> list[list[Hypothesis]]:
    """Hypotheses for each source row, starting with its ``prefix``: beam search when beam_size > 1,
    else greedy or sampling."""
    if options.beam_size > 1 and not options.sample:
        return beam_search(model, src, options, prefix)
    if options.sample and options.nbest > 1:  # n independent samples per source, best first
        rows = torch.arange(src.shape[0], device=src.device).repeat_interleave(options.nbest)
        samples = greedy_or_sample(model, src[rows], options, None if prefix is None else prefix[rows])
        groups = [samples[i:i + options.nbest] for i in range(0, len(samples), options.nbest)]
        return [sorted(group, key=lambda h: -h.score) for group in groups]
    return [[h] for h in greedy_or_sample(model, src, options, prefix)]


@dataclass
class Translation:
    source: str
    outputs: list[tuple[str, Hypothesis]]  # best first; text and hypothesis
    truncated: bool = False  # the source was longer than the model's positions
    utilities: list[float] | None = None  # with MBR: each output's expected utility


def translate(model: torch.nn.Module | Ensemble, vocab: Vocabulary, texts: list[str], options: DecodeOptions,
              batch_size: int | None = None, device: torch.device | str = "cpu",
              prefixes: list[str] | None = None, max_tokens: int | None = None) -> list[Translation]:
    """Translate texts in length-sorted batches of at most ``batch_size`` sentences and ``max_tokens``
    hypothesis tokens (see ``decoding_batches``); results come back in input order. Each output starts
    with the text's entry in ``prefixes``, if given and not empty. With ``options.mbr``, the ``nbest``
    candidates of highest expected utility come back, best first (see ``mbr.py``).

    Empty texts give an empty output without running the model; sources longer than the model's
    positions are truncated (keeping the closing EOS) and flagged.
    """
    from tformer_cli.batching import decoding_batches, pad_sequences

    models = as_ensemble(model)
    max_len = models.max_len
    ids = vocab.encode_sources(texts)
    results = [Translation(text, [("", Hypothesis([], 0.0, 0.0))], len(s) > max_len) for text, s in zip(texts, ids)]
    ids = [s[: max_len - 1] + s[-1:] if len(s) > max_len else s for s in ids]
    order = sorted((i for i, text in enumerate(texts) if text.strip()), key=lambda i: len(ids[i]))
    prefixed = Prefix.of(vocab, prefixes) if prefixes else None
    search = options.candidates() if options.mbr else options
    metric = sentence_metric(options.mbr_metric) if options.mbr else None
    for batch in decoding_batches([len(ids[i]) for i in order], options, batch_size, max_tokens):
        chunk = order[batch.start:batch.stop]
        src = pad_sequences([ids[i] for i in chunk]).to(device)
        prefix = prefixed[chunk] if prefixed is not None and any(prefixed.texts[i] for i in chunk) else None
        for i, hyps in zip(chunk, decode_batch(models, src, search, prefix)):
            outputs = list(zip(vocab.decode_targets([h.tokens for h in hyps]), hyps))
            if metric is not None:
                ranking, utilities = rank([text for text, _ in outputs], metric)
                outputs = [outputs[j] for j in ranking[:options.nbest]]
                results[i].utilities = utilities[:options.nbest]
            results[i].outputs = outputs
    return results
