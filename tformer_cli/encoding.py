"""The token ids of a split: tokenised once, filtered by length, and cached as safetensors.

A split is tokenised with the run's vocabulary (``tokenizer.py``), in worker processes when it is
large, and cached under ``cache_dir()`` keyed by the data, its settings and the vocabulary, so that the
next run over the same data starts at once. Learning the vocabulary and tokenising may run in a child
process (``preparing.py``), which takes the heap that tokenizers grows with it when it ends.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tformer_cli.config import DataConfig
from tformer_cli.data import read_pairs
from tformer_cli.data_paths import data_file_names, file_versions
from tformer_cli.errors import CheckpointError, first_line
from tformer_cli.files import error_number, replacing
from tformer_cli.sequences import Sequences, TextPairs
from tformer_cli.tokenizer import RECIPE, Vocabulary, usable_cpus

# Encoded splits cached in an earlier layout, or by an earlier reader, are not read (3: safetensors, no
# pickle; 4: plain-text files read without a byte-order mark)
CACHE_FORMAT = 4
ENCODE_CHUNK = 100_000  # pairs tokenised at a time: their ids as Python lists are the peak memory
# BPE-dropout's draw beside training: a chunk's ids become a tensor in one call that holds the GIL
# (~27 ms for Multi30k's 29,000 pairs at once, ~10 ms in chunks of 10,000, as fast in all)
DRAW_CHUNK = 10_000
# A split of this many pairs or more is tokenised by worker processes, a range of it each: the cores
# work in parallel on the Python side too, and the heap that tokenizers grows while encoding (about
# 330 MiB per million texts, never returned) goes away with each worker
ENCODE_IN_WORKERS = 500_000
MAX_ENCODE_WORKERS = 8
TRAINING_ONLY = {"bpe_dropout"}  # data settings that change neither the vocabulary nor the cached encodings


def cache_dir() -> Path:
    """Where encoded datasets and trained tokenizers are cached ($TFORMER_CACHE, else ~/.cache/tformer)."""
    return Path(os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer")  # set but empty: unset


@dataclass
class EncodedSplit:
    """One split as token ids (source: x_1 ... x_n </s>; target: <s> y_1 ... y_m </s>), with the raw
    texts kept for BLEU and BPE-dropout. ``src`` and ``tgt`` may be given as lists of lists."""

    src: Sequences
    tgt: Sequences
    pairs: TextPairs
    dropped_empty: int = 0
    dropped_long: int = 0
    truncated: int = 0
    checksum: str | None = field(default=None, compare=False, repr=False)  # the cache entry's, where read from one

    def __post_init__(self) -> None:
        self.src, self.tgt = (s if isinstance(s, Sequences) else Sequences.from_lists(s) for s in (self.src, self.tgt))
        if not isinstance(self.pairs, TextPairs):
            self.pairs = TextPairs.from_pairs(self.pairs)

    def __len__(self) -> int:
        return len(self.src)

    def signature(self) -> str:
        """A digest of the split's ids and texts: equal for the same pairs tokenised alike, wherever they
        are read. A split read from the cache has it already (its entry's checksum, verified on reading)."""
        return (self.checksum or _checksum(split_tensors(self)))[:16]


def data_fingerprint(cfg: DataConfig, split: str, *extra: Any) -> str:
    """A key that changes when the data, its selection or its processing changes."""
    settings = {k: v for k, v in vars(cfg).items() if k not in TRAINING_ONLY}
    spec: dict[str, Any] = {"split": split, "extra": extra, "cfg": settings}
    files = data_file_names(cfg.data_files.get(split, []), cfg.format) if cfg.data_files else []
    paths = [Path(p) for p in files] + ([Path(cfg.dataset)] if not cfg.data_files and cfg.dataset else [])
    spec["stat"] = [file_versions(p) for p in paths]
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def encode_split(pairs: Sequence[tuple[str, str]], vocab: Vocabulary, cfg: DataConfig,
                 chunk: int = ENCODE_CHUNK) -> EncodedSplit:
    """Tokenise both sides a chunk at a time (``pairs``: a list, ``ArrowPairs`` or ``TextPairs``);
    drop empty pairs and drop or truncate over-long ones."""
    out = EncodedSplit([], [], [])
    limit = cfg.max_length
    src_parts, tgt_parts, text_parts = [], [], []
    for start in range(0, len(pairs), chunk):
        some = pairs[start:start + chunk]
        kept = [(s, t) for s, t in some if s.strip() and t.strip()]
        out.dropped_empty += len(some) - len(kept)
        src_ids, tgt_ids, texts = [], [], []
        sources = vocab.encode_sources([s for s, _ in kept])
        targets = vocab.encode_targets([t for _, t in kept])
        for s, t, pair in zip(sources, targets, kept):
            if len(s) > limit or len(t) > limit:
                if cfg.long_pairs == "drop":
                    out.dropped_long += 1
                    continue
                s, t = s[: limit - 1] + s[-1:], t[: limit - 1] + t[-1:]  # keep the closing EOS
                out.truncated += 1
            src_ids.append(s)
            tgt_ids.append(t)
            texts.append(pair)
        src_parts.append(Sequences.from_lists(src_ids))
        tgt_parts.append(Sequences.from_lists(tgt_ids))
        text_parts.append(TextPairs.from_pairs(texts))
    out.src, out.tgt, out.pairs = Sequences.concat(src_parts), Sequences.concat(tgt_parts), TextPairs.concat(text_parts)
    return out


def resegment(split: EncodedSplit, vocab: Vocabulary, cfg: DataConfig, share: tuple[int, int] = (0, 1)) -> EncodedSplit:
    """The split's pairs segmented afresh with BPE-dropout ``cfg.bpe_dropout`` (one epoch's worth);
    ``share`` (i, n): the i-th of n contiguous shares of them alone, which the i-th of n processes draws
    (``joined`` puts the shares back together)."""
    (i, n), size = share, len(split.pairs)
    pairs = _PairRange(split.pairs, size * i // n, size * (i + 1) // n)
    return encode_split(pairs, vocab.with_dropout(cfg.bpe_dropout), cfg, DRAW_CHUNK)


def joined(parts: list[EncodedSplit]) -> EncodedSplit:
    """Parts of a split, each of a contiguous range of its pairs, in order: the split."""
    return EncodedSplit(Sequences.concat([p.src for p in parts]), Sequences.concat([p.tgt for p in parts]),
                        TextPairs.concat([p.pairs for p in parts]),
                        **{name: sum(getattr(p, name) for p in parts) for name in ENCODED_COUNTS})


def _encoded_path(cfg: DataConfig, split: str, vocab: Vocabulary) -> Path:
    key = data_fingerprint(cfg, split, vocab.fingerprint(), CACHE_FORMAT)
    return cache_dir() / "encoded" / f"{split}-{key}.safetensors"


def load_encoded(cfg: DataConfig, split: str, vocab: Vocabulary,
                 notice: Callable[[str], None] = lambda message: None) -> EncodedSplit:
    """``read_pairs`` + ``encode_split``, cached on disk by data and tokenizer fingerprint. An entry
    that cannot be read back exactly is rebuilt, after one line to ``notice``."""
    path = _encoded_path(cfg, split, vocab)
    if path.is_file():
        try:
            return read_encoded(path)
        except (OSError, ValueError) as exc:
            notice(f"rebuilding the cached encoding {path}: {exc}")
    pairs = read_pairs(cfg, split)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # no cache costs time next run, nothing else
        notice(_uncached(exc))
        return encode_split(pairs, vocab, cfg)
    workers = min(usable_cpus(), MAX_ENCODE_WORKERS) if len(pairs) >= ENCODE_IN_WORKERS else 1
    encoded = _encode_in_workers(cfg, split, vocab, len(pairs), workers) if workers > 1 \
        else encode_split(pairs, vocab, cfg)
    try:
        write_encoded(encoded, path)
        # read back: the cache is memory-mapped, so the processes of a node share one copy of the split
        return read_encoded(path)
    except (CheckpointError, OSError, ValueError) as exc:
        notice(_uncached(exc))
        return encoded


def _uncached(exc: BaseException) -> str:
    """The warning for a cache entry not written: the same for every entry that fails alike (a full
    disk), so that it is given once."""
    while exc.__cause__ is not None:  # a CheckpointError names the file: what it wraps does not
        exc = exc.__cause__
    code = error_number(exc)
    why = os.strerror(code) if code is not None else first_line(exc)
    return (f"the cache in {cache_dir()} cannot be written ({why}): the next run learns and tokenises again; set "
            "TFORMER_CACHE to a writable folder")


def _encode_in_workers(cfg: DataConfig, split: str, vocab: Vocabulary, size: int, workers: int) -> EncodedSplit:
    """``encode_split`` of the whole split, by ``workers`` processes a contiguous range each; each
    writes its part as a cache entry, read back memory-mapped and joined here. A worker that dies
    fails the whole (BrokenProcessPool) instead of leaving this process waiting."""
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    bounds = [size * i // workers for i in range(workers + 1)]
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="encoding-", dir=cache_dir()) as folder:
        paths = [Path(folder) / f"part-{i}.safetensors" for i in range(workers)]
        threads = max(1, usable_cpus() // workers)
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_encoding_worker,
                                 initargs=(threads,)) as pool:
            for done in [pool.submit(_encode_part, cfg, split, vocab, a, b, p)
                         for a, b, p in zip(bounds, bounds[1:], paths)]:
                done.result()  # a worker's DataError is raised here
        return joined([read_encoded(p) for p in paths])


def _encoding_worker(threads: int) -> None:
    """A tokenising worker's start: tokenizers' thread pool, made at its first batch, gets this
    process's share of the cores."""
    os.environ["RAYON_RS_NUM_CPUS"] = str(threads)


def _encode_part(cfg: DataConfig, split: str, vocab: Vocabulary, start: int, stop: int, path: Path) -> None:
    """In a worker: pairs [start, stop) of the split, encoded and written to ``path``."""
    write_encoded(encode_split(_PairRange(read_pairs(cfg, split), start, stop), vocab, cfg), path)


class _PairRange:
    """Pairs [start, stop) of a split, sliced as the split is."""

    def __init__(self, pairs: Sequence[tuple[str, str]], start: int, stop: int) -> None:
        self.pairs, self.start, self.size = pairs, start, stop - start

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> list[tuple[str, str]]:
        start, stop, _ = index.indices(self.size)
        return self.pairs[self.start + start:self.start + stop]


# A cache entry is data, never code: token ids and texts as safetensors tensors, counts in its metadata,
# and a checksum over all of them, so that a damaged or planted entry is rebuilt rather than believed.
_ENCODED_TENSORS = ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets", "text_bytes", "text_offsets")
ENCODED_COUNTS = ("dropped_empty", "dropped_long", "truncated")
_ENCODED_DTYPES = {"src_ids": torch.int32, "tgt_ids": torch.int32, "text_bytes": torch.uint8}


def split_tensors(split: EncodedSplit) -> dict[str, torch.Tensor]:
    """The split as a cache entry's tensors (``_ENCODED_TENSORS``); ``split_from_tensors`` reverses it."""
    text_bytes = split.pairs.data if split.pairs.data.numel() else torch.zeros(1, dtype=torch.uint8)  # none: 1 byte
    return {"src_ids": split.src.ids, "src_offsets": split.src.offsets,
            "tgt_ids": split.tgt.ids, "tgt_offsets": split.tgt.offsets,
            "text_bytes": text_bytes, "text_offsets": split.pairs.offsets}


def write_encoded(split: EncodedSplit, path: Path) -> None:
    """``split`` at ``path`` as a cache entry, written atomically."""
    with replacing(path) as tmp:
        save_encoded(split, tmp)


def save_encoded(split: EncodedSplit, path: Path) -> None:
    """``split`` at ``path``, which ``read_encoded`` reads back, written in place: for a file inside a
    folder that is itself written atomically (a checkpoint's)."""
    tensors = split_tensors(split)
    metadata = {"format": str(CACHE_FORMAT), "sha256": _checksum(tensors),
                **{name: str(count) for name, count in split_counts(split).items()}}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)


def read_encoded(path: Path) -> EncodedSplit:
    """An encoded split from the cache or a checkpoint. Raises ValueError (or OSError) for any file not
    written by ``save_encoded`` in this format, intact."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as stored:
            metadata = stored.metadata() or {}
            if metadata.get("format") != str(CACHE_FORMAT) or set(stored.keys()) != set(_ENCODED_TENSORS):
                raise ValueError("written by another version")
            tensors = {name: stored.get_tensor(name) for name in _ENCODED_TENSORS}
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own error for a file it cannot parse
        raise ValueError(f"unreadable ({first_line(exc)})") from exc
    if metadata.get("sha256") != _checksum(tensors):
        raise ValueError("its checksum does not match")
    for values, offsets in (("src_ids", "src_offsets"), ("tgt_ids", "tgt_offsets"), ("text_bytes", "text_offsets")):
        ends = tensors[offsets]
        if (tensors[values].dtype != _ENCODED_DTYPES[values] or ends.dtype != torch.int64 or ends.dim() != 1
                or ends.numel() == 0 or ends[0] != 0 or bool((ends.diff() < 0).any())
                or ends[-1] > tensors[values].numel()):
            raise ValueError(f"its {values} are malformed")
    split = split_from_tensors(tensors, {name: int(metadata[name]) for name in ENCODED_COUNTS}, metadata["sha256"])
    if len(split.tgt) != len(split) or len(split.pairs) != len(split) or split.pairs.offsets.numel() % 2 == 0:
        raise ValueError("its parts differ in length")
    return split


def split_from_tensors(tensors: dict[str, torch.Tensor], counts: dict[str, int],
                       checksum: str | None = None) -> EncodedSplit:
    """The split that ``split_tensors`` gave ``tensors`` of, with its counts of dropped and truncated pairs."""
    return EncodedSplit(Sequences(tensors["src_ids"], tensors["src_offsets"]),
                        Sequences(tensors["tgt_ids"], tensors["tgt_offsets"]),
                        TextPairs(tensors["text_bytes"][:int(tensors["text_offsets"][-1])], tensors["text_offsets"]),
                        **counts, checksum=checksum)  # without the byte that stands for no text (split_tensors)


def split_counts(split: EncodedSplit) -> dict[str, int]:
    """The split's counts of pairs dropped (empty, too long) and truncated."""
    return {name: getattr(split, name) for name in ENCODED_COUNTS}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in _ENCODED_TENSORS:
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy())  # the buffer itself, not a copy of it
    return digest.hexdigest()


def train_or_load_vocabulary(cfg: DataConfig, notice: Callable[[str], None] = lambda message: None) -> Vocabulary:
    """Learn BPE on the training split, or reuse one learned from the same data and settings."""
    folder = _vocabulary_folder(cfg)
    if folder.is_dir() and any(folder.iterdir()):  # an empty one: an earlier tformer's write cut short
        try:
            return Vocabulary.load(folder)
        except CheckpointError as exc:
            notice(f"relearning the cached vocabulary: {exc}")
    pairs = read_pairs(cfg, cfg.train_split)
    vocab = Vocabulary.train(pairs, cfg.vocab_size, cfg.joint_vocab, cfg.min_frequency, cfg.lowercase,
                             cfg.bpe_max_pairs)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with replacing(folder) as tmp:  # whole: a full disk leaves no folder without its files
            tmp.mkdir()
            vocab.save(tmp)
    except (CheckpointError, OSError) as exc:
        notice(_uncached(exc))
    return vocab


def _vocabulary_folder(cfg: DataConfig) -> Path:
    return cache_dir() / "tokenizers" / data_fingerprint(cfg, cfg.train_split, RECIPE)


def cached_vocabulary(cfg: DataConfig) -> Vocabulary | None:
    """The vocabulary learned for ``cfg``, where the cache holds a readable one."""
    try:
        return Vocabulary.load(_vocabulary_folder(cfg))
    except CheckpointError:
        return None


def encodings_cached(cfg: DataConfig, splits: Sequence[str], vocab: Vocabulary) -> bool:
    """Whether the cache holds the encodings of ``splits`` with ``vocab``."""
    return all(_encoded_path(cfg, split, vocab).is_file() for split in splits)
