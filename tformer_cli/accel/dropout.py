"""Dropout with a cheaper mask on CPU (the model's nn.Dropout modules are swapped for ``FastDropout``).

torch's CPU dropout draws its mask with ``bernoulli_``, one call of its Mersenne Twister per element
(``torch.rand`` is no cheaper), and keeps the mask for backward as float32. Here each 64-bit word
gives four 16-bit lanes, and a lane compared with a threshold is a Bernoulli(1 - p) draw with p
rounded to a multiple of 1/65536 (at least 1/65536). The words come from SplitMix64 (Steele, Lea and
Flood 2014; the seeder of xoshiro and Java's SplittableRandom): word i is a fixed mix of seed + i * gamma,
vectorised elementwise ops on all cores where the Mersenne Twister runs on one, its seed drawn from
torch's generator, so ``torch.manual_seed`` and saved RNG states govern the masks (timings:
benchmarks/README.md, "Small measurements"). On GPUs torch's fused kernel is used. ``dropout`` keeps a
one-byte mask for backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 65536  # values of a 16-bit lane


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p); identity when not training."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p == 1.0:
        return F.dropout(x, p, training=True)
    keep, scale = keep_mask(x.shape, p, x.device)
    # The mask's bytes read as uint8: torch copies a uint8 or bool mask to float before multiplying, from
    # uint8 faster than from bool; autograd keeps one byte
    return (x * keep.view(torch.uint8)).mul_(scale)


def keep_mask(shape: torch.Size, p: float, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bool) -> tuple[Tensor, float]:
    """A mask, True (or 1) with probability 1 - p' where p' is p rounded to a multiple of 1/65536,
    and 1 / (1 - p'), the scale that keeps the expected value."""
    n = math.prod(shape)
    lanes = random_words((n + 3) // 4, device).view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    dropped = min(max(round(p * LANES), 1), LANES - 1)  # lanes below the threshold are dropped
    keep = torch.empty(shape, dtype=dtype, device=device)
    torch.ge(lanes, dropped - LANES // 2, out=keep)
    return keep, LANES / (LANES - dropped)


def random_words(n: int, device: torch.device | str = "cpu") -> Tensor:
    """n uniform 64-bit words (int64): the next n outputs of SplitMix64 from a state drawn from torch's
    generator. Output i mixes state + i * gamma by two xor-shift-multiply rounds (``_mix``)."""
    seed = torch.empty((), dtype=torch.int64).random_(-2**63, 2**63 - 1)  # a tensor: no recompiles under torch.compile
    return _mix(_weyl(n, torch.device(device)).add(seed.to(device)))


_WEYL: dict[torch.device, Tensor] = {}


def _weyl(n: int, device: torch.device) -> Tensor:
    """(1, 2, ..., n) * gamma modulo 2^64, computed once per device and grown as needed."""
    table = _WEYL.get(device)
    if table is None or table.numel() < n:
        table = torch.arange(1, max(n, 2**16) + 1, dtype=torch.int64, device=device).mul_(_signed(0x9E3779B97F4A7C15))
        _WEYL[device] = table
    return table[:n]


def _mix(z: Tensor) -> Tensor:
    """SplitMix64's output function, in place on int64 words (wrapping multiplies; logical shifts)."""
    _xor_shift_(z, 30).mul_(_signed(0xBF58476D1CE4E5B9))
    _xor_shift_(z, 27).mul_(_signed(0x94D049BB133111EB))
    return _xor_shift_(z, 31)


def _xor_shift_(z: Tensor, shift: int) -> Tensor:
    """z ^= z >> shift, with the shift logical (int64's >> is arithmetic: mask off the copied sign)."""
    return z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))


def _signed(word: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return word - 2**64 if word >= 2**63 else word


class FastDropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
