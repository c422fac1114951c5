"""Token id sequences stored flat: every id in one int32 tensor, and the offset where each sequence starts.

A Python list of lists costs about 36 bytes a token (an 8-byte pointer and, for ids above 256, a
28-byte int object); here a token costs 4, so that corpora of millions of pairs fit in memory. A cached
split also loads as two buffers instead of millions of objects, and a batch is padded by one gather
instead of a loop over its rows (measured: benchmarks/README.md).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import torch
from torch import Tensor


class Sequences:
    """An immutable list of token id sequences: ``seqs[i]`` is a list of ints, ``len(seqs)`` their number."""

    def __init__(self, ids: Tensor, offsets: Tensor) -> None:
        self.ids = ids  # (total tokens,) int32
        self.offsets = offsets  # (n + 1,) int64: sequence i is ids[offsets[i]:offsets[i + 1]]

    @classmethod
    def from_lists(cls, sequences: Iterable[list[int]]) -> "Sequences":
        sequences = list(sequences)
        lengths = torch.tensor([0] + [len(s) for s in sequences], dtype=torch.int64)
        ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.int32)
        return cls(ids, lengths.cumsum(0))

    @classmethod
    def concat(cls, parts: list["Sequences"]) -> "Sequences":
        return cls(*_concat([(p.ids, p.offsets) for p in parts])) if parts else cls.from_lists([])

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> list[int]:
        return self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for part in torch.split(self.ids, self.lengths().tolist()):
            yield part.tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequences):
            return NotImplemented
        return torch.equal(self.offsets, other.offsets) and torch.equal(self.ids, other.ids)

    def lengths(self) -> Tensor:
        """(n,) int64: each sequence's number of tokens."""
        return self.offsets[1:] - self.offsets[:-1]

    def pad(self, indices: list[int], pad_id: int) -> Tensor:
        """Sequences ``indices`` as rows of a (len(indices), longest) int64 tensor, padded with ``pad_id``."""
        rows = torch.as_tensor(indices, dtype=torch.int64)
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts  # (B,)
        columns = torch.arange(int(lengths.max()))  # (L,)
        positions = (starts[:, None] + columns).clamp_(max=max(self.ids.numel() - 1, 0))  # (B, L)
        return self.ids[positions].long().masked_fill_(columns >= lengths[:, None], pad_id)


class TextPairs:
    """(source, target) texts stored flat as UTF-8: every text's bytes in one uint8 tensor, and the
    offset where each starts (two a pair). A pair becomes Python strings only when it is read: a Python
    string costs ~50 bytes more than its text, and a cached split's texts load as two buffers."""

    def __init__(self, data: Tensor, offsets: Tensor) -> None:
        self.data = data  # (total bytes,) uint8
        self.offsets = offsets  # (2n + 1,) int64: text j is data[offsets[j]:offsets[j + 1]]

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]]) -> "TextPairs":
        texts = [text.encode("utf-8", "surrogatepass") for pair in pairs for text in pair]
        offsets = torch.tensor([0] + [len(t) for t in texts], dtype=torch.int64).cumsum(0)
        joined = b"".join(texts)
        data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
        return cls(data, offsets)

    @classmethod
    def concat(cls, parts: list["TextPairs"]) -> "TextPairs":
        return cls(*_concat([(p.data, p.offsets) for p in parts])) if parts else cls.from_pairs([])

    def __len__(self) -> int:
        return (self.offsets.numel() - 1) // 2

    def __getitem__(self, index: int | slice) -> tuple[str, str] | list[tuple[str, str]]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("TextPairs slices take every pair")
            return self._decode(start, max(start, stop))
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._decode(index % len(self), index % len(self) + 1)[0]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for start in range(0, len(self), 100_000):
            yield from self[start:start + 100_000]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TextPairs):
            return torch.equal(self.offsets, other.offsets) and torch.equal(self.data[:self.offsets[-1]],
                                                                           other.data[:other.offsets[-1]])
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    def _decode(self, start: int, stop: int) -> list[tuple[str, str]]:
        bounds = self.offsets[2 * start:2 * stop + 1]
        if bounds.numel() < 2:
            return []
        base = int(bounds[0])
        raw = self.data[base:int(bounds[-1])].numpy().tobytes()
        ends = (bounds - base).tolist()
        texts = [raw[a:b].decode("utf-8", "surrogatepass") for a, b in zip(ends, ends[1:])]
        return list(zip(texts[::2], texts[1::2]))


def _concat(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Flat (values, offsets) parts joined into one: each part's offsets shifted by the values before it."""
    starts = itertools.accumulate((values.numel() for values, _ in parts[:-1]), initial=0)
    offsets = [parts[0][1][:1]] + [offsets[1:] + start for (_, offsets), start in zip(parts, starts)]
    return torch.cat([values for values, _ in parts]), torch.cat(offsets)
