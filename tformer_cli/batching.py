"""Batches by tokens: training examples of similar length grouped under a padded-token budget, then
padded; and the batches that decoding cuts from sources sorted by length."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from tformer_cli.config import TrainConfig
from tformer_cli.encoding import EncodedSplit
from tformer_cli.tokenizer import PAD_ID

if TYPE_CHECKING:
    from tformer_cli.decoding import DecodeOptions
    from tformer_cli.model.transformer import Rows


def real_positions(tgt_out: torch.Tensor) -> torch.Tensor:
    """(N,) where ``tgt_out.flatten()`` holds its N real (non-pad) tokens."""
    return (tgt_out.flatten() != PAD_ID).nonzero().squeeze(1)


@dataclass
class Batch:
    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T): <s> y_1 ... y_m
    tgt_out: torch.Tensor  # (B, T): y_1 ... y_m </s>
    indices: list[int]  # positions in the split
    # ``real_positions(tgt_out)``, found where the batch is made (on the host), so that the loss selects
    # the real tokens without waiting for the GPU to count them
    real: torch.Tensor | None = None
    rows: "Rows | None" = None  # sentences packed into rows (``packing.pack``); None: one sentence a row, padded

    def __post_init__(self) -> None:
        if self.real is None:
            self.real = real_positions(self.tgt_out)

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) target tokens."""
        return self.real.numel()

    def at_real(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) values of the target positions -> (num_tokens, ...) those of the real tokens."""
        return x.flatten(0, 1).index_select(0, self.real)

    def to(self, device: torch.device | str) -> "Batch":
        # CUDA copies from pageable memory wait until the GPU has finished its queue; from pinned memory
        # they queue behind it, and the host goes on to queue the step's kernels
        pin = torch.device(device).type == "cuda"

        def moved(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return Batch(moved(self.src), moved(self.tgt_in), moved(self.tgt_out), self.indices, moved(self.real),
                     None if self.rows is None else self.rows.map(moved))


def token_batches(src_lengths: Sequence[int] | torch.Tensor, tgt_lengths: Sequence[int] | torch.Tensor,
                  max_tokens: int, seed: int = 0, epoch: int = 0, shuffle: bool = True, rank: int = 0,
                  world_size: int = 1, multiple: int = 1) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens (on the longer side).

    Examples are sorted by length (ties broken randomly per epoch) so each batch holds similar lengths
    and padding stays small; the batch order is then shuffled from (seed, epoch). A batch into which
    ``multiple`` examples or more fit holds a multiple of ``multiple`` (the rest start the next batch),
    as fairseq's ``--required-batch-size-multiple``: its products then have row counts (sentences x
    positions) from a smaller set, which on CPUs means fewer kernels for oneDNN to build and keep
    (benchmarks/README.md, "Memory in real training"). With ``rank`` and
    ``world_size``, each process takes every world_size-th batch, all the same number (the last
    len % world_size batches of the epoch's order are left out), so the processes step together.
    Sorting is vectorised and each batch's end found by bisection: WMT 2014's 4.5 M pairs take 0.4 s
    (from tensors of lengths, as ``Sequences.lengths`` gives them), a stall between two epochs.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    lengths = torch.maximum(torch.as_tensor(src_lengths, dtype=torch.int64),
                            torch.as_tensor(tgt_lengths, dtype=torch.int64)).double()  # (n,)
    if shuffle:  # noise in [0, 1) orders equal lengths at random, never across lengths
        lengths += torch.rand(lengths.shape, generator=generator, dtype=torch.float64)
    # positive doubles sort as their bits do, read as int64: the same order, sorted 5x faster
    order = torch.argsort(lengths.view(torch.int64), stable=True)
    longest = lengths[order].floor().long().tolist()  # ascending: a batch's last example is its longest
    ends, start, n = [], 0, len(longest)
    while start < n:  # the largest end with longest[end - 1] * (end - start) <= max_tokens; one example at least
        fits = bisect.bisect_right(range(n + 1), max_tokens, lo=start + 1,
                                   key=lambda end: longest[end - 1] * (end - start))
        size = fits - 1 - start
        if size >= multiple:
            size -= size % multiple
        start += max(size, 1)
        ends.append(start)
    order = order.tolist()
    batches = [order[begin:end] for begin, end in zip([0] + ends[:-1], ends)]
    if shuffle:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches[rank:len(batches) - len(batches) % world_size:world_size]


def shared_out(steps: list[list[int]], processes: int, accumulation: int, rank: int) -> list[list[int]]:
    """Each step's examples dealt into ``processes`` x ``accumulation`` batches (a step's example j to
    batch j mod that), of which process ``rank`` takes batches rank, rank + processes, ...: its
    ``accumulation`` batches of each step, in order. Dealt, each batch spans its step's lengths, so the
    processes' batches are alike and none waits on another's longer one. A step of fewer examples
    than batches (the last of an epoch's length order, or one of a few very long sentences) is left out."""
    parts = processes * accumulation
    return [step[k::parts] for step in steps if len(step) >= parts for k in range(rank, parts, processes)]


def epoch_batches(data: EncodedSplit, cfg: TrainConfig, epoch: int, rank: int = 0, processes: int = 1
                  ) -> list[list[int]]:
    """Process ``rank``'s batches of training ``epoch``, in their order; each optimizer step takes
    ``batches_per_step`` consecutive ones. With ``train.step_tokens`` the steps are cut first, the same
    for any number of processes, and shared out; else each process takes every N-th batch of
    ``train.max_tokens``."""
    lengths = data.src.lengths(), data.tgt.lengths()
    if cfg.step_tokens is None:
        return token_batches(*lengths, cfg.max_tokens, cfg.seed, epoch, rank=rank, world_size=processes,
                             multiple=cfg.batch_multiple)
    steps = token_batches(*lengths, cfg.step_tokens, cfg.seed, epoch, multiple=cfg.batch_multiple)
    return shared_out(steps, processes, batches_per_step(cfg, processes), rank)


def batches_per_step(cfg: TrainConfig, processes: int) -> int:
    """Batches each process takes an optimizer step: ``train.grad_accum``, or as many as keep a share
    of ``train.step_tokens`` within ``train.max_tokens``."""
    if cfg.step_tokens is None:
        return cfg.grad_accum
    return math.ceil(cfg.step_tokens / (processes * cfg.max_tokens))


def collate(split: EncodedSplit, indices: list[int]) -> Batch:
    """Pad one batch: sources to their longest, targets shifted into input and output."""
    src = split.src.pad(indices, PAD_ID)
    tgt = split.tgt.pad(indices, PAD_ID)
    return Batch(src, tgt[:, :-1], tgt[:, 1:], indices)


def pad_sequences(sequences: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(sequences), max(map(len, sequences))), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


# Hypotheses (sentences x beams, or x samples) decoded together by default. More rows per step make its
# matrix products cheaper per row, until beam search's rows outgrow the packed products (linear.MAX_ROWS)
# and the kernels oneDNN builds per row count (benchmarks/README.md, "Small measurements").
HYPOTHESES_PER_BATCH = 256


def hypotheses_per_sentence(options: DecodeOptions) -> int:
    """Rows a sentence takes in a decoding step: its beams, its samples, or its MBR candidates."""
    if options.mbr:
        options = options.candidates()
    return options.nbest if options.sample else options.beam_size


def sentences_per_batch(options: DecodeOptions, batch_size: int | None = None, max_tokens: int | None = None) -> int:
    """The most sentences one batch holds: ``batch_size`` where one is set (decode.batch_size,
    --batch-size); else, with ``max_tokens``, as many as fit it at the shortest source (two tokens);
    else HYPOTHESES_PER_BATCH rows a step."""
    if batch_size:
        return batch_size
    return max(1, (max_tokens // 2 if max_tokens else HYPOTHESES_PER_BATCH) // hypotheses_per_sentence(options))


def decoding_batches(lengths: list[int], options: DecodeOptions, batch_size: int | None = None,
                     max_tokens: int | None = None) -> list[range]:
    """Cut sources sorted by length (``lengths`` ascending, in tokens) into consecutive batches of
    positions: at most ``sentences_per_batch`` sentences, and with ``max_tokens`` (decode.max_tokens,
    --max-tokens) at most that many hypothesis tokens, sentences x hypotheses per sentence x the
    batch's longest source, as fairseq's --max-tokens (scaled by the beam: one budget bounds the
    memory of greedy and beam search alike). A sentence longer than the budget is a batch alone."""
    width, most = hypotheses_per_sentence(options), sentences_per_batch(options, batch_size, max_tokens)
    batches, start = [], 0
    while start < len(lengths):
        end, limit = start + 1, min(start + most, len(lengths))
        # ascending lengths: the source added last is the batch's longest
        while end < limit and (not max_tokens or (end - start + 1) * width * lengths[end] <= max_tokens):
            end += 1
        batches.append(range(start, end))
        start = end
    return batches
