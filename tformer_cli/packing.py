"""Sentence pairs packed end to end into rows for training (``train.pack_length``), as T5 packs its
examples: a batch of ~27-token sentences padded to its longest becomes rows of about
``pack_length`` tokens, each holding several sentences on both sides. The model attends within each
sentence and restarts positions at each (``model.Rows``), so a packed sentence is computed as it
would be alone, and the loss is the same. What it saves is on a GPU: attention kernels work in tiles
of 64 or 128 positions for each sentence and head, mostly padding for short sentences, and a row
fills a tile with several of them.
"""

from __future__ import annotations

import torch

from tformer_cli.batching import Batch, collate
from tformer_cli.encoding import EncodedSplit
from tformer_cli.model.transformer import Rows
from tformer_cli.tokenizer import PAD_ID


def training_batch(data: EncodedSplit, ids: list[int], pack_length: int | None) -> Batch:
    """The training batch of ``data``'s pairs ``ids``: padded, or with a ``pack_length``
    (``train.pack_length``) its pairs packed into rows."""
    batch = collate(data, ids)
    return batch if pack_length is None else pack(batch, pack_length)


def pack(batch: Batch, length: int) -> Batch:
    """``batch``'s pairs, in order, end to end in rows: k sentences of the batch's longest fit a row,
    k = max(1, ``length`` // longest), at most the batch's sentences, and a row takes sentences while
    both its sides fit (each side k times that side's longest). Targets keep their shift: a sentence's
    input ``<s> y_1 ... y_m`` and output ``y_1 ... y_m </s>`` sit in the same columns."""
    src_lengths = (batch.src != PAD_ID).sum(1)  # (B,)
    tgt_lengths = (batch.tgt_out != PAD_ID).sum(1)  # (B,) the input holds as many (its </s> is padding)
    longest_src, longest_tgt = int(src_lengths.max()), int(tgt_lengths.max())
    k = max(1, min(len(src_lengths), length // max(longest_src, longest_tgt)))  # wider would be padding alone
    width_src, width_tgt = k * longest_src, k * longest_tgt
    rows, src_starts, tgt_starts, segments = [], [], [], []  # each sentence's row, first columns, number
    row, used_src, used_tgt, segment = 0, 0, 0, 0
    for s, t in zip(src_lengths.tolist(), tgt_lengths.tolist()):
        if used_src + s > width_src or used_tgt + t > width_tgt:
            row, used_src, used_tgt, segment = row + 1, 0, 0, 0
        segment += 1
        rows.append(row)
        src_starts.append(used_src)
        tgt_starts.append(used_tgt)
        segments.append(segment)
        used_src, used_tgt = used_src + s, used_tgt + t
    rows, segments = torch.tensor(rows), torch.tensor(segments)
    (src,), src_segments, src_positions = _placed(
        [batch.src], src_lengths, torch.tensor(src_starts), rows, segments, width_src)
    (tgt_in, tgt_out), tgt_segments, tgt_positions = _placed(
        [batch.tgt_in, batch.tgt_out], tgt_lengths, torch.tensor(tgt_starts), rows, segments, width_tgt)
    return Batch(src, tgt_in, tgt_out, batch.indices, rows=Rows(src_segments, src_positions, tgt_segments,
                                                                 tgt_positions))


def _placed(padded: list[torch.Tensor], lengths: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor,
            segments: torch.Tensor, width: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One side's (B, T) padded tensors (the target's input and output share a layout) put into
    (R, width) rows: each sentence's first ``lengths`` tokens at row ``rows``, from column ``starts``.
    Also that side's sentence numbers in their rows (0 on padding, from ``segments``) and positions."""
    B, T = padded[0].shape
    R = int(rows[-1]) + 1
    positions = torch.arange(T).expand(B, T)  # (B, T)
    real = (positions < lengths[:, None]).flatten().nonzero().squeeze(1)  # (N,) a sentence's tokens, in (B * T)
    to = (rows[:, None] * width + starts[:, None] + positions).flatten()[real]  # (N,) their places in (R * width)

    def filled(values: torch.Tensor, empty: int) -> torch.Tensor:  # (B, T) -> (R, width)
        out = torch.full((R * width,), empty, dtype=values.dtype)
        return out.index_copy_(0, to, values.reshape(-1)[real]).view(R, width)

    return ([filled(t, PAD_ID) for t in padded], filled(segments[:, None].expand(B, T), 0),
            filled(positions, 0))
