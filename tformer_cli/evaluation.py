"""Loss, perplexity, BLEU and chrF.

The loss is label-smoothed cross-entropy (§5.4) over real target tokens only: the output
projection and softmax, which dominate a small model's cost, are computed at non-pad positions.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tformer_cli.accel import ops
from tformer_cli.batching import Batch, collate, token_batches
from tformer_cli.encoding import EncodedSplit
from tformer_cli.ensemble import Ensemble, as_ensemble
from tformer_cli.devices import compile_unsupported
from tformer_cli.errors import ConfigError, DataError
from tformer_cli.loss import linear_smoothed_cross_entropy

if TYPE_CHECKING:
    from tformer_cli.config import DataConfig
    from tformer_cli.decoding import DecodeOptions
    from tformer_cli.parallel import Workers
    from tformer_cli.tokenizer import Vocabulary


def label_smoothed_loss(model: torch.nn.Module, batch: Batch, smoothing: float,
                        rdrop: float = 0.0) -> tuple[Tensor, Tensor]:
    """Sum over real target tokens of (1 - eps) * NLL + eps * mean_v(-log p_v), and the plain NLL sum.

    The output projection runs only at non-pad positions, fused with the loss (see ``loss.py``).
    With ``rdrop`` (R-Drop, Liang et al. 2021) the batch runs twice in one forward, under different
    dropout masks: the loss is the passes' mean plus rdrop times their symmetric KL divergence.

    Returns:
        (smoothed loss sum to back-propagate, NLL sum, detached).
    """
    return _fused_loss(model, batch, real_hidden(model, batch, rdrop), smoothing, rdrop)


def real_hidden(model: torch.nn.Module, batch: Batch, rdrop: float = 0.0) -> Tensor:
    """The decoder's states at the batch's real target tokens (N, d_model); with ``rdrop``, both passes'
    (2N, d_model), the first pass's tokens, then the second's."""
    src, tgt_in, real, rows = batch.src, batch.tgt_in, batch.real, batch.rows  # real: non-pad tokens in tgt_out
    if rdrop:
        src, tgt_in = torch.cat([src, src]), torch.cat([tgt_in, tgt_in])
        rows = None if rows is None else rows.map(lambda t: torch.cat([t, t]))
    hidden = model.decode(tgt_in, model.encode(src, rows=rows), rows=rows).hidden  # (B, T, d_model), or (2B, ...)
    # selected by position, not by a mask, whose row count the host would wait for the GPU to find
    return hidden.flatten(0, 1).index_select(0, torch.cat([real, real + batch.tgt_out.numel()])) if rdrop \
        else batch.at_real(hidden)


def _fused_loss(model: torch.nn.Module, batch: Batch, rows: Tensor, smoothing: float,
                rdrop: float) -> tuple[Tensor, Tensor]:
    return linear_smoothed_cross_entropy(rows, model.output_proj.weight, batch.at_real(batch.tgt_out), smoothing,
                                         rdrop)


def compiles(setting: str | bool, device: torch.device) -> bool:
    """Whether training compiles its loss (``train.compile``): true, false, or auto, on a GPU that
    torch.compile compiles for. On an H200 compiled base trains 1.22x as many tokens a second as eager,
    after ~98 s of compiling; on CPUs compiled steps are slower (benchmarks/README.md). ConfigError
    where true asks for what cannot compile."""
    if setting == "auto":
        return device.type == "cuda" and compile_unsupported(device) is None
    if setting and (why := compile_unsupported(device)):
        raise ConfigError(f"train.compile true: {why}; set train.compile=false, or auto (compiled where it can be)")
    return bool(setting)


def compiled_loss() -> Callable[..., tuple[Tensor, Tensor]]:
    """``label_smoothed_loss`` as ``train.compile`` runs it: the encoder and decoder under torch.compile
    (one graph, dynamic shapes, each size a symbol of its own), the hand-fused loss eager after it.
    Traced, the loss's chunk loop would recompile for every batch's token count."""
    hidden = ops.dynamic_sizes_only(torch.compile(real_hidden, dynamic=True))

    def loss(model: torch.nn.Module, batch: Batch, smoothing: float, rdrop: float = 0.0) -> tuple[Tensor, Tensor]:
        return _fused_loss(model, batch, hidden(model, batch, rdrop), smoothing, rdrop)

    return loss


class Seq2SeqLoss(torch.nn.Module):
    """The training objective as one module: encoder, decoder and the fused loss in one ``forward``,
    which is where DistributedDataParallel and FSDP hook in, so that they see the whole step.
    ``loss`` computes it (``label_smoothed_loss``, or a compiled copy of it)."""

    def __init__(self, model: torch.nn.Module, smoothing: float, rdrop: float = 0.0,
                 loss: Callable[..., tuple[Tensor, Tensor]] = label_smoothed_loss) -> None:
        super().__init__()
        self.model = model
        self.smoothing, self.rdrop, self.loss = smoothing, rdrop, loss

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """(smoothed loss sum, NLL sum) over the batch's real target tokens."""
        return self.loss(self.model, batch, self.smoothing, self.rdrop)


@dataclass
class LossResult:
    loss: float  # mean NLL per target token (nats)
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module | Ensemble, split: EncodedSplit, max_tokens: int,
                  device: torch.device | str = "cpu", batch_multiple: int = 1, shard: tuple[int, int] = (0, 1)
                  ) -> LossResult:
    """Teacher-forced mean NLL per target token over a whole split (of the ensemble's averaged
    probabilities, for several models). ``shard`` (i, n): over every n-th batch from the i-th only,
    one process's share of a loss that n processes compute together."""
    models = as_ensemble(model)
    was_training = [m.training for m in models.models]
    for m in models.models:
        m.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0  # read once, at the end
    index, count = shard
    for indices in token_batches(split.src.lengths(), split.tgt.lengths(), max_tokens, shuffle=False,
                                 multiple=batch_multiple)[index::count]:
        batch = collate(split, indices).to(device)
        if len(models.models) == 1:
            nll = label_smoothed_loss(models.models[0], batch, 0.0)[1]
        else:
            nll = ensemble_nll(models, batch)
        total += nll
        tokens += batch.num_tokens
    for m, training in zip(models.models, was_training):
        m.train(training)
    return LossResult(float(total) / max(tokens, 1), tokens)


def ensemble_nll(models: Ensemble, batch: Batch) -> Tensor:
    """NLL sum over the batch's real target tokens of the models' averaged probabilities."""
    log_probs = torch.stack([batch.at_real(m(batch.src, batch.tgt_in)).float().log_softmax(dim=-1)
                             for m in models.models])
    averaged = torch.logsumexp(log_probs, dim=0) - math.log(len(models.models))  # (tokens, V)
    return -averaged.gather(1, batch.at_real(batch.tgt_out)[:, None]).sum()


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict[str, float | str]:
    """Cased sacreBLEU, lowercased BLEU, chrF and exact match of detokenised text."""
    import sacrebleu

    bleu = sacrebleu.BLEU()
    cased = bleu.corpus_score(hypotheses, [references])
    lower = sacrebleu.BLEU(lowercase=True).corpus_score(hypotheses, [references])
    chrf = sacrebleu.CHRF().corpus_score(hypotheses, [references])
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / max(len(references), 1)
    return {"bleu": cased.score, "bleu_lowercase": lower.score, "chrf": chrf.score, "exact_match": 100.0 * exact,
            "bleu_signature": str(bleu.get_signature())}


def validation_record(model: torch.nn.Module, vocab, split: EncodedSplit, train_cfg, decode_cfg, step: int,
                      device: torch.device | str = "cpu", workers: "Workers | None" = None) -> dict[str, Any]:
    """What training logs at a validation: loss and perplexity over ``split``, and with
    ``validates_bleu`` the scores of greedy translations of its first ``train.eval_max_sentences``
    sources. With ``workers``, each process computes its share (every N-th batch of the loss, every
    N-th sentence) and all get the figures one process computes (``Workers.sum``, ``Workers.gather``)."""
    shard = (workers.rank, workers.size) if workers else (0, 1)
    start = time.perf_counter()
    part = evaluate_loss(model, split, train_cfg.max_tokens, device, train_cfg.batch_multiple, shard)
    loss = part.loss
    if workers:  # the shares' summed NLL over all their tokens
        nll, tokens = workers.sum(part.loss * part.tokens, part.tokens)
        loss = nll / max(tokens, 1)
    record: dict[str, Any] = {"step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if validates_bleu(train_cfg):
        pairs = split.pairs[:train_cfg.eval_max_sentences]
        sources = [source for source, _ in pairs][shard[0]::shard[1]]
        ours = validation_hypotheses(model, vocab, sources, decode_cfg, device)
        shares = workers.gather(ours) if workers else [ours]
        hypotheses = [h for row in itertools.zip_longest(*shares) for h in row if h is not None]  # in order again
        record.update(validation_scores(hypotheses, [target for _, target in pairs]))
    record["seconds"] = time.perf_counter() - start
    return record


def validates_bleu(train_cfg) -> bool:
    """Whether validation translates and scores, not only computes the loss."""
    return train_cfg.eval_bleu or train_cfg.best_metric == "bleu"


def validation_hypotheses(model: torch.nn.Module, vocab, sources: list[str], decode_cfg,
                          device: torch.device | str = "cpu") -> list[str]:
    """Validation's greedy translations of ``sources``."""
    from tformer_cli.decoding import translate

    was_training = model.training
    model.eval()
    results = translate(model, vocab, sources, _validation_search(decode_cfg), decode_cfg.batch_size, device,
                        max_tokens=decode_cfg.max_tokens)
    model.train(was_training)
    return [r.outputs[0][0] for r in results]


def validation_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """The scores validation logs: cased BLEU, chrF and exact match."""
    scores = corpus_scores(hypotheses, references)
    return {key: scores[key] for key in ("bleu", "chrf", "exact_match")}


def validation_rows(decode_cfg, sentences: int) -> int:
    """The most hypotheses a step of ``validation_hypotheses`` decodes together, over ``sentences`` sentences."""
    from tformer_cli.batching import sentences_per_batch

    return min(sentences, sentences_per_batch(_validation_search(decode_cfg), decode_cfg.batch_size,
                                              decode_cfg.max_tokens))


def _validation_search(decode_cfg):
    from tformer_cli.decoding import DecodeOptions

    return DecodeOptions(beam_size=1, max_len_a=decode_cfg.max_len_a, max_len_b=decode_cfg.max_len_b)


def evaluate_run(model: torch.nn.Module | Ensemble, vocab: Vocabulary, data_cfg: DataConfig, split: str,
                 options: DecodeOptions, batch_size: int | None, loss_tokens: int,
                 device: torch.device | str = "cpu", batch_multiple: int = 1, decode_tokens: int | None = None) -> dict:
    """Teacher-forced loss and perplexity (batches of ``loss_tokens`` padded tokens, as training's),
    then decoding (batches of ``batch_size`` sentences and ``decode_tokens`` hypothesis tokens): BLEU
    (cased and lowercased), chrF, exact match and speed, on one split. Returns the figures and the
    hypotheses in input order."""
    from tformer_cli.data import load_pairs
    from tformer_cli.decoding import translate
    from tformer_cli.encoding import encode_split

    pairs = load_pairs(data_cfg, split)
    empty = sum(not target.strip() for _, target in pairs)
    if empty == len(pairs):
        raise DataError(f"every reference ({data_cfg.target}) of split '{split}' is empty: eval scores "
                        "translations against references; to translate without them, use tformer generate")
    # pairs cut to the positions of every model: an ensemble's may have fewer than the first run's data takes
    limit = min(data_cfg.max_length, as_ensemble(model).max_len)
    encoded = encode_split(pairs, vocab, replace(data_cfg, long_pairs="truncate", max_length=limit))
    loss = evaluate_loss(model, encoded, loss_tokens, device, batch_multiple)
    start = time.perf_counter()
    results = translate(model, vocab, [source for source, _ in pairs], options, batch_size, device,
                        max_tokens=decode_tokens)
    seconds = time.perf_counter() - start
    hypotheses = [r.outputs[0][0] for r in results]
    generated = sum(len(r.outputs[0][1].tokens) + 1 for r in results)  # EOS included
    return {"split": split, "sentences": len(pairs), "loss": loss.loss, "perplexity": loss.perplexity,
            **corpus_scores(hypotheses, [target for _, target in pairs]),
            "decode_seconds": seconds, "sentences_per_s": len(pairs) / seconds, "tokens_per_s": generated / seconds,
            "empty_references": empty, "hypotheses": hypotheses}
