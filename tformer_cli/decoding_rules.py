"""What may come next at a decoding step, whatever the search: the output's length limit, a prefix it
must start with, no end of sentence before ``min_len`` tokens, and no repeated n-gram."""

from __future__ import annotations

import bisect
import functools
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tformer_cli.tokenizer import EOS_ID, NOT_OUTPUTS, Vocabulary

if TYPE_CHECKING:
    from tformer_cli.decoding import DecodeOptions


class Pieces:
    """A target vocabulary's tokens as the text they write in an output ("▁drei", "und"), indexed to
    find the tokens that may continue a text. ``pieces``: per id, None for special tokens."""

    def __init__(self, pieces: list[str | None]) -> None:
        self.size = len(pieces)
        self._chars = torch.tensor([len(p or "") for p in pieces])
        self._ids = {p: i for i, p in enumerate(pieces) if p}
        self._sorted = sorted(self._ids)
        self._longest = max(map(len, self._ids), default=0)
        # the masks of the texts met lately, as a batch's rows mostly share their prefix; not all of
        # them, as a long-running generate meets ever new prefixes and a mask is V bytes
        self.next_tokens = functools.lru_cache(maxsize=1024)(self._next_tokens)

    def chars(self, tokens: Tensor) -> Tensor:
        """How many characters each token writes."""
        if self._chars.device != tokens.device:
            self._chars = self._chars.to(tokens.device)
        return self._chars[tokens]

    def _next_tokens(self, left: str) -> Tensor | None:
        """(V,) bool: the tokens that fit in ``left`` or begin with it (special tokens never); None where
        there is none. Kept for the texts met lately as ``next_tokens``."""
        fitting = [self._ids[left[:n]] for n in range(1, min(len(left), self._longest) + 1) if left[:n] in self._ids]
        start = bisect.bisect_left(self._sorted, left)
        stop = bisect.bisect_left(self._sorted, left + "\U0010ffff", lo=start)
        ids = fitting + [self._ids[p] for p in self._sorted[start:stop]]
        if not ids:
            return None
        allowed = torch.zeros(self.size, dtype=torch.bool)
        allowed[ids] = True
        return allowed


_PIECES: weakref.WeakKeyDictionary[Vocabulary, Pieces] = weakref.WeakKeyDictionary()  # built once a vocabulary


class Prefix:
    """Texts that outputs must start with (``--prefix``), kept a character at a time: while a row has
    not yet written its text, the next token must either fit in what is left of the text or begin with
    all of it. So the model chooses how the text is split into tokens, and a text that ends mid-word is
    completed: with "einund", "twenty-one" gives "einundzwanzig", where forcing the text's own tokens
    ("▁ein", "und") would leave the model to begin a new word after them (token healing, in general).

    ``texts``: per row, its prefix as the tokens would spell it ("" for none), as
    ``Vocabulary.spell_prefix`` gives them."""

    def __init__(self, pieces: Pieces, texts: list[str]) -> None:
        self.pieces, self.texts = pieces, texts

    @classmethod
    def of(cls, vocab: Vocabulary, texts: list[str]) -> "Prefix":
        if vocab not in _PIECES:
            _PIECES[vocab] = Pieces(vocab.target_pieces())
        return cls(_PIECES[vocab], [vocab.spell_prefix(text) for text in texts])

    def __getitem__(self, rows: Tensor | list[int]) -> "Prefix":
        """The prefixes of these rows, in this order (rows may repeat)."""
        return Prefix(self.pieces, [self.texts[i] for i in (rows.tolist() if isinstance(rows, Tensor) else rows)])

    def lengths(self, device: torch.device) -> Tensor:
        """(B,) each row's prefix in characters: the most tokens it can take."""
        return torch.tensor([len(text) for text in self.texts], device=device)

    def inside(self, rows: list[int], written: Tensor) -> tuple[Tensor, Tensor] | None:
        """The rows (of ``rows``, each a prefix's row) that have written ``written`` (b,) characters, fewer
        than their prefix holds, and for each the tokens that may come next (r, V) bool; None when all
        rows are past their prefixes. Reads ``written`` on the host."""
        left = [self.texts[row][n:] for row, n in zip(rows, written.tolist())]
        masks = [(i, self.pieces.next_tokens(text)) for i, text in enumerate(left) if text]
        # a text that no token fits (a vocabulary without single characters) leaves its row free
        masks = [(i, mask) for i, mask in masks if mask is not None]
        if not masks:
            return None
        inside, allowed = zip(*masks)
        return torch.tensor(inside, device=written.device), torch.stack(allowed).to(written.device)


def max_new_tokens(src: Tensor, pad_id: int, options: DecodeOptions, model_max_len: int,
                   prefix: Prefix | None = None) -> Tensor:
    """(B,) output length limits: a * source_length + b, room for ``min_len`` tokens, and room for a
    prefix spelled a character a token and one token past it, within the model's positions."""
    src_len = (src != pad_id).sum(dim=1).float()
    # within the positions before the cast: past int64 it would wrap to its most negative
    limit = (options.max_len_a * src_len + options.max_len_b).clamp(max=model_max_len - 1).long()
    if prefix is not None:
        limit = torch.maximum(limit, prefix.lengths(src.device) + 1)
    return limit.clamp(min=max(options.min_len, 1), max=model_max_len - 1)  # min > max: max wins


def constrain(log_probs: Tensor, t: int, options: DecodeOptions, history: Tensor | None,
              inside: tuple[Tensor, Tensor] | None) -> None:
    """Apply, in place, the rules on which token may come at step ``t`` to each row's log-probabilities
    (b, V), given the row's tokens so far ``history`` (b, t) and, from ``Prefix.inside``, the rows still
    inside their prefix with the tokens it allows them: never padding nor the start symbol, no EOS
    before ``min_len`` tokens, no repeated n-gram, and inside a prefix only what the prefix allows
    (with their own log-probabilities, so that the prefix counts in the score). A row that the n-gram
    ban leaves no token but EOS ends there, short of ``min_len``: no output could have both."""
    log_probs[:, NOT_OUTPUTS] = float("-inf")  # no target's tokens (fairseq forbids padding too)
    kept = None
    if inside is not None:
        rows, allowed = inside
        kept = log_probs[rows].masked_fill_(~allowed, float("-inf"))
    eos = log_probs[:, EOS_ID].clone() if t < options.min_len else None
    if eos is not None:
        log_probs[:, EOS_ID] = float("-inf")
    if options.no_repeat_ngram:
        ban_repeats(log_probs, history, options.no_repeat_ngram)
        if eos is not None:
            stuck = log_probs.amax(dim=-1) == float("-inf")  # (b,)
            log_probs[:, EOS_ID] = torch.where(stuck, eos, log_probs[:, EOS_ID])
    if kept is not None:
        log_probs[rows] = kept


def ban_repeats(log_probs: Tensor, history: Tensor, n: int) -> None:
    """Forbid (in place) every token that would complete an n-gram already in the row's ``history``
    (b, t): the tokens that followed an earlier occurrence of the row's last n - 1 tokens."""
    t = history.shape[1]
    if t < n:
        return
    grams = history.unfold(1, n, 1)  # (b, t - n + 1, n)
    last = history[:, t - n + 1:]  # (b, n - 1)
    rows, at = (grams[:, :, :-1] == last[:, None, :]).all(dim=-1).nonzero(as_tuple=True)
    log_probs[rows, grams[rows, at, -1]] = float("-inf")
