"""Decoding's row-wise argmax and top-k, fast on a CPU: torch's own walk every element of a row one at
a time, while block maxima are vectorised. Both give torch's results (tests/test_decoding.py); off the
CPU they are torch's."""

from __future__ import annotations

import torch
from torch import Tensor


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(-1)`` for a (b, V) tensor: the first index of each row's maximum. On a CPU torch's
    argmax walks a row one element at a time while ``amax`` is vectorised, so this takes the maximum
    of each block of 64 columns, the first block holding the row's maximum, and the argmax inside
    that block only; columns past the last whole block are compared after (timings:
    benchmarks/README.md, "Small measurements")."""
    b, V = x.shape
    block = 64
    whole = V - V % block
    if x.device.type != "cpu" or whole == 0:
        return x.argmax(dim=-1)
    rows = torch.arange(b, device=x.device)
    blocks = x[:, :whole].reshape(b, whole // block, block)  # a view: rows keep their stride
    maxima = blocks.amax(dim=-1)  # (b, whole / block)
    first = maxima.argmax(dim=-1)  # (b,)
    best = first * block + blocks[rows, first].argmax(dim=-1)
    if whole == V:
        return best
    tail_max, tail_arg = x[:, whole:].max(dim=-1)
    return torch.where(tail_max > maxima[rows, first], whole + tail_arg, best)  # a tie: the earlier column


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
