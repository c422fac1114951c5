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

from tformer_cli.batching import Batch
from tformer_cli.model.transformer import Rows
from tformer_cli.tokenizer import PAD_ID


def pack(batch: Batch, length: int) -> Batch:
    """``batch``'s pairs, in order, end to end in rows: k sentences of the batch's longest fit a row,
    k = max(1, ``length`` // longest), and a row takes sentences while both its sides fit (each side
    k times that side's longest). Targets keep their shift: a sentence's input ``<s> y_1 ... y_m`` and
    output ``y_1 ... y_m </s>`` sit in the same columns."""
    src_lengths = (batch.src != PAD_ID).sum(1)  # (B,)
    tgt_lengths = (batch.tgt_out != PAD_ID).sum(1)  # (B,) the input holds as many (its </s> is padding)
    longest_src, longest_tgt = int(src_lengths.max()), int(tgt_lengths.max())
    k = max(1, length // max(longest_src, longest_tgt))
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
    place = _Placing(torch.tensor(rows), torch.tensor(segments), row + 1)
    src, src_segments, src_positions = place(batch.src, src_lengths, torch.tensor(src_starts), width_src)
    tgt_in, tgt_segments, tgt_positions = place(batch.tgt_in, tgt_lengths, torch.tensor(tgt_starts), width_tgt)
    tgt_out, _, _ = place(batch.tgt_out, tgt_lengths, torch.tensor(tgt_starts), width_tgt)
    return Batch(src, tgt_in, tgt_out, batch.indices, rows=Rows(src_segments, src_positions, tgt_segments,
                                                                 tgt_positions))


class _Placing:
    """Puts one side's sentences (rows of a padded batch) into the packed rows, vectorised."""

    def __init__(self, rows: torch.Tensor, segments: torch.Tensor, count: int) -> None:
        self.rows, self.segments, self.count = rows, segments, count  # (B,), (B,), R

    def __call__(self, padded: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T) padded sentences, their (B,) lengths and first columns -> the (R, width) packed ids,
        and each token's sentence number (0 on padding) and position in its sentence."""
        B, T = padded.shape
        positions = torch.arange(T).expand(B, T)  # (B, T)
        real = positions < lengths[:, None]  # (B, T): a sentence's first ``length`` tokens
        row = self.rows[:, None].expand(B, T)[real]  # (N,) each real token's row and column
        column = (starts[:, None] + positions)[real]
        ids = torch.full((self.count, width), PAD_ID, dtype=padded.dtype)
        segments = torch.zeros((self.count, width), dtype=torch.int64)
        places = torch.zeros((self.count, width), dtype=torch.int64)
        ids[row, column] = padded[real]
        segments[row, column] = self.segments[:, None].expand(B, T)[real]
        places[row, column] = positions[real]
        return ids, segments, places
