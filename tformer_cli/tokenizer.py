"""Subword BPE tokenizers (Hugging Face `tokenizers`): train, save, load, encode, decode.

A joint vocabulary (one tokenizer for both sides, as the paper shares embeddings) is the default;
with separate vocabularies the source and target each get their own. Spaces are kept as the
metaspace marker, so decoding gives back the original text (punctuation and accents included).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tformer_cli.errors import CheckpointError, first_line
from tformer_cli.files import write_text_atomic


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# tokenizers' own count of the CPUs can come out as one (benchmarks/README.md, "Data at the paper's
# scale"): its thread pool gets the CPUs this process may run on, unless the user set it
os.environ.setdefault("RAYON_RS_NUM_CPUS", str(usable_cpus()))

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
NOT_OUTPUTS = slice(PAD_ID, BOS_ID + 1)  # ids that decoding never writes: padding and the start symbol
RECIPE = "bpe/nfc+spaces/metaspace+punctuation/v3"  # part of the cache key: change it when the recipe changes
JOINT_FILE, SOURCE_FILE, TARGET_FILE = "tokenizer.json", "tokenizer-source.json", "tokenizer-target.json"


def _new_tokenizer(lowercase: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    # Unicode's NFC; no byte-order mark (files joined with cat keep theirs mid-text); any run of white
    # space (tabs, no-break spaces, line ends) one space, none at either end: "seven  hundred " is
    # "seven hundred", as SentencePiece's default normalisation has it
    steps = [normalizers.NFC(), normalizers.Replace("\ufeff", ""), normalizers.Replace(Regex(r"\s+"), " "),
             normalizers.Strip()]
    tokenizer.normalizer = normalizers.Sequence(steps + ([normalizers.Lowercase()] if lowercase else []))
    # Words keep their leading space as "▁"; punctuation becomes tokens of its own ("forty", "-", "two").
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def train_bpe(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, min_frequency: int = 2,
              lowercase: bool = False) -> Tokenizer:
    """Learn a BPE vocabulary of at most ``vocab_size`` entries (special tokens included) from texts,
    or batches of texts (faster: tokenizers counts a batch's words on all cores)."""
    tokenizer = _new_tokenizer(lowercase)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIALS,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class Vocabulary:
    """The source and target tokenizers of a run (the same object when the vocabulary is joint)."""

    def __init__(self, source: Tokenizer, target: Tokenizer | None = None) -> None:
        self.source = source
        self.target = target or source

    @property
    def joint(self) -> bool:
        return self.source is self.target

    @property
    def src_size(self) -> int:
        return self.source.get_vocab_size()

    @property
    def tgt_size(self) -> int:
        return self.target.get_vocab_size()

    @classmethod
    def train(cls, pairs: Sequence[tuple[str, str]], vocab_size: int, joint: bool = True, min_frequency: int = 2,
              lowercase: bool = False, max_pairs: int | None = None) -> "Vocabulary":
        """Learn BPE on ``pairs`` (anything with len and slices: a list, ``data.ArrowPairs``), or on
        ``max_pairs`` of them, taken in evenly spaced blocks across the whole split."""
        if joint:
            return cls(train_bpe(_batches(pairs, (0, 1), max_pairs), vocab_size, min_frequency, lowercase))
        return cls(train_bpe(_batches(pairs, (0,), max_pairs), vocab_size, min_frequency, lowercase),
                   train_bpe(_batches(pairs, (1,), max_pairs), vocab_size, min_frequency, lowercase))

    def save(self, folder: Path) -> None:
        """Write tokenizer.json (joint) or tokenizer-source.json + tokenizer-target.json, atomically."""
        files = {JOINT_FILE: self.source} if self.joint else {SOURCE_FILE: self.source, TARGET_FILE: self.target}
        for name, tokenizer in files.items():
            write_text_atomic(folder / name, tokenizer.to_str())

    @staticmethod
    def files(folder: Path) -> list[str]:
        """The names of the tokenizer files saved in ``folder``."""
        return [JOINT_FILE] if (Path(folder) / JOINT_FILE).is_file() else [SOURCE_FILE, TARGET_FILE]

    @classmethod
    def load(cls, folder: Path) -> "Vocabulary":
        """Raises CheckpointError (one line) for a missing or unreadable tokenizer file."""
        folder = Path(folder)
        if (folder / JOINT_FILE).is_file():
            return cls(_read(folder / JOINT_FILE))
        if (folder / SOURCE_FILE).is_file() and (folder / TARGET_FILE).is_file():
            return cls(_read(folder / SOURCE_FILE), _read(folder / TARGET_FILE))
        raise CheckpointError(f"{folder}: no {JOINT_FILE} (or {SOURCE_FILE} + {TARGET_FILE}); "
                              "is this a run folder written by `tformer train`?")

    def with_dropout(self, p: float) -> "Vocabulary":
        """A copy that skips each BPE merge with probability ``p`` (BPE-dropout), for training only."""
        noisy = {id(t): Tokenizer.from_str(t.to_str()) for t in (self.source, self.target)}
        for tokenizer in noisy.values():
            tokenizer.model.dropout = p
        return Vocabulary(noisy[id(self.source)], noisy[id(self.target)])

    def fingerprint(self) -> str:
        import hashlib

        text = self.source.to_str() + ("" if self.joint else self.target.to_str())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def encode_sources(self, texts: list[str]) -> list[list[int]]:
        """Source ids end with EOS: x_1 ... x_n </s>."""
        return [ids + [EOS_ID] for ids in _ids(self.source, texts)]

    def encode_targets(self, texts: list[str]) -> list[list[int]]:
        """Target ids are wrapped: <s> y_1 ... y_m </s>."""
        return [[BOS_ID] + ids + [EOS_ID] for ids in _ids(self.target, texts)]

    def encode_prefixes(self, texts: list[str]) -> list[list[int]]:
        """Target ids of the texts that outputs must start with, without BOS or EOS."""
        return _ids(self.target, texts)

    def spell_prefix(self, text: str) -> str:
        """``text`` as the target tokens of an output that starts with it spell it, joined: normalised,
        words marked with "▁" ("drei hundert" is "▁drei▁hundert"), and a closing "▁" where the text
        ends in a space, so that the next word is a new one. Empty for a text of white space alone."""
        if not text.strip():
            return ""
        spelled = "".join(self.target.encode(text, add_special_tokens=False).tokens)
        return spelled + ("▁" if text[-1].isspace() else "")

    def target_pieces(self) -> list[str | None]:
        """Each target id's text as it stands in an output's tokens ("▁drei", "und"); None for the
        special tokens, which spell nothing."""
        pieces = [self.target.id_to_token(i) for i in range(self.tgt_size)]
        return [None if i < len(SPECIALS) else piece for i, piece in enumerate(pieces)]

    def unknown_target_characters(self, text: str) -> str:
        """The characters of ``text`` that the target vocabulary has no token for, each once, in order."""
        encoding = self.target.encode(text, add_special_tokens=False)
        unknown = (text[start:end] for i, (start, end) in zip(encoding.ids, encoding.offsets) if i == UNK_ID)
        return "".join(dict.fromkeys(unknown))

    def decode_targets(self, sequences: Iterable[list[int]]) -> list[str]:
        """Ids (specials dropped) back to text."""
        return self.target.decode_batch([list(s) for s in sequences], skip_special_tokens=True)

    def source_tokens(self, ids: list[int]) -> list[str]:
        return [self.source.id_to_token(i) for i in ids]

    def target_tokens(self, ids: list[int]) -> list[str]:
        return [self.target.id_to_token(i) for i in ids]


def _read(path: Path) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own error for any file it cannot parse
        raise CheckpointError(f"{path}: unreadable tokenizer ({first_line(exc)}); restore it from a copy "
                              "of the run, or train the run again") from None
    if any(tokenizer.token_to_id(token) != i for i, token in enumerate(SPECIALS)):
        raise CheckpointError(f"{path}: not a tformer tokenizer (its special tokens differ); restore the run's "
                              "own tokenizer file")
    return tokenizer


def _ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    # encode_batch_fast (tokenizers >= 0.20) leaves out the character offsets, which tformer does not
    # use (13 % faster)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


def _batches(pairs: Sequence[tuple[str, str]], sides: tuple[int, ...], max_pairs: int | None = None,
             size: int = 10_000) -> Iterator[list[str]]:
    """The texts of ``sides`` (0: source, 1: target) of ``pairs``, ``size`` pairs at a time; with
    ``max_pairs``, only that many, in blocks spread evenly from the first pair to the last."""
    n = len(pairs)
    if max_pairs is None or n <= max_pairs:
        blocks = [(start, min(start + size, n)) for start in range(0, n, size)]
    else:
        count = max(1, max_pairs // size)
        width = max_pairs // count
        blocks = [(start, start + width) for start in (i * (n - width) // max(1, count - 1) for i in range(count))]
    for start, stop in blocks:
        yield [pair[side] for pair in pairs[start:stop] for side in sides]
