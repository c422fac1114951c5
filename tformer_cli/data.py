"""Parallel data through Hugging Face `datasets`: load, tokenise (cached), filter, batch by tokens.

``data.dataset`` is a hub id or a local dataset folder; ``data.data_files`` maps splits to files
(json/jsonl, csv, parquet, or a [source, target] pair of plain-text files; .gz allowed).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors.torch import save_file

from tformer_cli.config import DataConfig
from tformer_cli.errors import CheckpointError, DataError, first_line
from tformer_cli.files import replacing
from tformer_cli.sequences import Sequences, TextPairs
from tformer_cli.tokenizer import PAD_ID, RECIPE, Vocabulary, usable_cpus

# Encoded splits cached in an earlier layout are not read (3: safetensors, no pickle)
CACHE_FORMAT = 3
ENCODE_CHUNK = 100_000  # pairs tokenised at a time: their ids as Python lists are the peak memory
# A split of this many pairs or more is tokenised by worker processes, a range of it each: the cores
# work in parallel on the Python side too, and the heap that tokenizers grows while encoding (about
# 330 MiB per million texts, never returned) goes away with each worker
ENCODE_IN_WORKERS = 500_000
MAX_ENCODE_WORKERS = 8
# Data capped below this many pairs (data.max_samples) is learnt and tokenised in the training process:
# what that leaves behind is small, and a child process's start (~2 s) would cost more than it saves
PREPARE_APART_FROM = 10_000
TRAINING_ONLY = {"bpe_dropout"}  # data settings that change neither the vocabulary nor the cached encodings
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def cache_dir() -> Path:
    """Where encoded datasets and trained tokenizers are cached ($TFORMER_CACHE, else ~/.cache/tformer)."""
    return Path(os.environ.get("TFORMER_CACHE", Path.home() / ".cache" / "tformer"))


# ---------------------------------------------------------------------------------------------
# Loading raw text pairs
# ---------------------------------------------------------------------------------------------


def absolute_paths(cfg: DataConfig) -> DataConfig:
    """``cfg`` with the local dataset folder and data files that exist made absolute, so that a run
    folder's config finds its data from any directory (``tformer eval runs/x`` run elsewhere); hub ids
    and missing paths stay as written."""
    def absolute(path: Any) -> Any:
        if isinstance(path, list):
            return [absolute(p) for p in path]
        local = Path(path).expanduser() if isinstance(path, str) else None
        return str(local.resolve()) if local is not None and local.exists() else path

    files = {split: absolute(f) for split, f in cfg.data_files.items()} if cfg.data_files else cfg.data_files
    return replace(cfg, dataset=absolute(cfg.dataset), data_files=files)


def local_sources(cfg: DataConfig) -> list[Path]:
    """The local data files, or the local dataset folder, that ``cfg``'s splits are read from (none
    for a hub dataset), resolved."""
    if cfg.data_files:
        files = [[f] if isinstance(f, str) else f for f in cfg.data_files.values()]
        return [Path(f).expanduser().resolve() for split in files for f in split]
    folder = Path(cfg.dataset).expanduser()
    return [folder.resolve()] if folder.is_dir() else []


def load_pairs(cfg: DataConfig, split: str) -> list[tuple[str, str]]:
    """The (source, target) texts of one split, trimmed to ``max_samples``, as Python strings (for the
    splits that are evaluated; ``read_pairs`` reads a training split of millions a slice at a time).

    Raises:
        DataError: the dataset, split, file or field cannot be found or read.
    """
    return list(read_pairs(cfg, split))


def read_pairs(cfg: DataConfig, split: str) -> "ArrowPairs":
    """The (source, target) texts of one split, trimmed to ``max_samples``, read from the split's Arrow
    table (memory-mapped by ``datasets``) a slice at a time.

    Raises:
        DataError: the dataset, split, file or field cannot be found or read.
    """
    if cfg.data_files:
        if split not in cfg.data_files:
            raise DataError(f"data.data_files has no split '{split}' (has: {', '.join(cfg.data_files)}); "
                            f"add it or set the split name in data.*_split")
        files = cfg.data_files[split]
        files = [files] if isinstance(files, str) else list(files)
        fmt = cfg.format if cfg.format != "auto" else _format_of(files)
    where = f"{', '.join(files) if cfg.data_files else cfg.dataset}: split '{split}'"
    try:
        if not cfg.data_files:
            pairs = _columns(_load_named(cfg.dataset, cfg.subset, split), cfg, where)
        else:
            pairs = _text_pairs(files, where) if fmt == "text" else _columns(_load_files(fmt, files), cfg, where)
    except UnicodeDecodeError as exc:
        raise _not_utf8(where, exc) from None
    if not len(pairs):
        raise DataError(f"split '{split}' of {cfg.data_files or cfg.dataset} is empty; check the files or split name")
    if cfg.max_samples:
        pairs.size = min(pairs.size, cfg.max_samples)
    return pairs


class ArrowPairs:
    """A split's (source, target) texts, read from Arrow tables (which ``datasets`` memory-maps) a slice
    at a time, so that a split of millions of pairs is never all Python strings at once: a list of
    pairs to ``len``, slicing (``pairs[a:b]``) and iteration."""

    def __init__(self, sources, targets, source: str, target: str, where: str) -> None:
        self.tables, self.columns, self.where = (sources, targets), (source, target), where
        self.size = len(sources)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> list[tuple[str, str]]:
        start, stop, _ = index.indices(self.size)
        try:  # pyarrow keeps the bytes as they are and decodes them here
            sources, targets = (table[start:stop][column] for table, column in zip(self.tables, self.columns))
        except UnicodeDecodeError as exc:
            raise _not_utf8(self.where, exc) from None
        return [("" if s is None else str(s), "" if t is None else str(t)) for s, t in zip(sources, targets)]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for start in range(0, self.size, ENCODE_CHUNK):
            yield from self[start:start + ENCODE_CHUNK]


def _not_utf8(where: str, exc: UnicodeDecodeError) -> DataError:
    return DataError(f"{where} is not UTF-8 text (a byte {exc.object[exc.start:exc.start + 1]!r}); convert the "
                     "data to UTF-8, e.g. iconv -t UTF-8")


def _format_of(files: list[str]) -> str:
    """The format that the first file's extension names; two files without a known extension are a
    source and a target text file, named by their languages as Moses and fairseq name them (train.de,
    train.en)."""
    formats = [FORMATS.get(next((s for s in reversed(Path(f).suffixes) if s != ".gz"), "")) for f in files]
    if formats[0] is not None:
        return formats[0]
    if len(files) == 2 and not any(formats):
        return "text"
    raise DataError(f"cannot tell the format of '{files[0]}' from its extension; name it .jsonl, .csv, .parquet or "
                    ".txt, or set data.format to json, csv, parquet or text")


def _check_files(files: list[str]) -> None:
    for path in files:
        if not Path(path).is_file():
            raise DataError(f"data file not found: {path}; fix data.data_files (paths are relative to the "
                            "current directory)")
        if Path(path).stat().st_size == 0:
            raise DataError(f"{path}: the file is empty; point data.data_files (or --data-files) at the data")


def _load_files(fmt: str, files: list[str]):
    import datasets

    _check_files(files)
    datasets.disable_progress_bars()
    failed: list[str] = []
    try:
        with _datasets_errors(failed):
            return datasets.load_dataset(fmt, data_files={"split": files}, split="split")
    except Exception as exc:  # datasets raises many kinds for unreadable files, the cause chained inside
        cause = _root_cause(exc)
        if isinstance(cause, UnicodeDecodeError):
            raise cause from None  # load_pairs names the files
        where = failed[-1] if failed else ", ".join(files)
        if "invalid utf8" in str(cause).lower():  # pyarrow's csv reader, which has no exception of its own for it
            raise DataError(f"{where}: not UTF-8 text ({first_line(cause)}); convert the data to UTF-8, "
                            "e.g. iconv -t UTF-8") from None
        raise DataError(f"could not read {where} as {fmt}: {first_line(_parser_error(exc))}") from exc


@contextmanager
def _datasets_errors(failed: list[str]) -> Iterator[None]:
    """Keep datasets' error lines off the terminal (the error raised says it once), noting in ``failed``
    the files they name: its readers log the file that failed, then raise an error without it."""
    import logging
    import re

    class FileNames(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            named = re.search(r"from file '([^']+)'|read file '([^']+)'", record.getMessage())
            if named:
                failed.append(named.group(1) or named.group(2))

    logger = logging.getLogger("datasets")
    handlers, level = logger.handlers, logger.level
    logger.handlers = [FileNames()]
    logger.setLevel(logging.ERROR)  # setLevel, not .level: its modules' loggers cache whether a level is on
    try:
        yield
    finally:
        logger.handlers = handlers
        logger.setLevel(level)


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    return exc


def _parser_error(exc: BaseException) -> BaseException:
    """The error a file's parser raised, under datasets' wrappers: the end of the chain of explicit
    causes (``raise ... from``); a fallback parser's failure hangs below it as mere context."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _text_pairs(files: list[str], where: str) -> ArrowPairs:
    if len(files) != 2:
        raise DataError(f"plain-text data needs two parallel files [source, target] per split, got {files}")
    source, target = (_load_files("text", [f]) for f in files)
    if len(source) != len(target):
        raise DataError(f"parallel files differ in length: {files[0]} has {len(source)} lines, "
                        f"{files[1]} has {len(target)}")
    return ArrowPairs(source, target, "text", "text", where)


def _load_named(name: str, subset: str | None, split: str):
    import datasets

    datasets.disable_progress_bars()
    local = Path(name).exists()
    if not local and name.startswith(("/", "./", "../", "~")):  # a path, not a hub id (owner/name)
        raise DataError(f"data.dataset: no such folder '{name}'; check the path (relative paths start "
                        "from the current directory)")
    unreachable = None if local else _hub_unreachable()
    failed: list[str] = []
    try:
        with _hub_offline() if unreachable else nullcontext(), _datasets_errors(failed):
            dataset = datasets.load_dataset(name, subset)
    except Exception as exc:
        wrong_subset = None if unreachable else _wrong_subset(name, subset)
        if wrong_subset:
            raise DataError(f"data.subset: {wrong_subset}") from exc
        if local and failed:  # a file datasets could not parse: the file and the parser's own words
            raise DataError(f"could not read {failed[-1]} of the dataset folder '{name}': "
                            f"{first_line(_parser_error(exc))}") from exc
        if local:
            raise DataError(f"could not load the dataset folder '{name}': {first_line(exc)}; a dataset folder holds "
                            "a file per split, e.g. train.jsonl, validation.jsonl, test.jsonl") from exc
        why = (f": it is unreachable ({unreachable}) and the datasets cache has no copy;" if unreachable
               else f" ({type(exc).__name__}); offline, or a folder elsewhere?")
        raise DataError(
            f"could not load '{name}': no such folder here (relative paths start from the current directory), "
            f"and from the Hugging Face hub{why} point at local data: "
            "train --set data.dataset=path/to/folder (or data.data_files), eval --data-files FILE"
        ) from exc
    if split not in dataset:
        raise DataError(f"dataset '{name}' has no split '{split}' (has: {', '.join(dataset)}); "
                        "set data.train_split / validation_split / test_split")
    return dataset[split]


def _wrong_subset(name: str, subset: str | None) -> str | None:
    """What is wrong with ``subset`` for the dataset ``name``, or None where it is not the problem."""
    import datasets

    try:
        subsets = datasets.get_dataset_config_names(name)
    except Exception:
        return None
    if subset is None and len(subsets) > 1:
        return f"'{name}' has several subsets ({', '.join(subsets)}); pick one, e.g. --set data.subset={subsets[0]}"
    if subset is not None and subset not in subsets:
        return f"'{name}' has no subset '{subset}' (has: {', '.join(subsets)})"
    return None


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, found by opening one connection to it (3 s at most), or None.
    Offline, huggingface_hub would otherwise retry five times (~25 s) before failing. Not checked in
    offline mode (HF_HUB_OFFLINE) or behind a proxy, which connects for us."""
    import datasets

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if datasets.config.HF_HUB_OFFLINE or any(os.environ.get(name) for name in proxies):
        return None
    endpoint = urlparse(datasets.config.HF_ENDPOINT)
    host = endpoint.hostname or datasets.config.HF_ENDPOINT
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)  # HF_ENDPOINT may name a mirror
    try:
        socket.create_connection((host, port), timeout=3).close()
    except socket.gaierror:
        return f"no address for {host}"
    except OSError as exc:
        return f"cannot connect to {host}:{port}, {type(exc).__name__}"
    return None


@contextmanager
def _hub_offline():
    """`datasets` and huggingface_hub in offline mode inside the block: a hub dataset loads from the
    local cache, or fails at once. Their HF_HUB_OFFLINE is read from the environment at import time, so
    the module flags are set here, and restored."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _columns(dataset, cfg: DataConfig, where: str) -> ArrowPairs:
    flat = dataset.flatten()
    for key, name in (("data.source", cfg.source), ("data.target", cfg.target)):
        if name not in flat.column_names:
            nested = [f for f in flat.column_names if f.endswith("." + name)]  # e.g. translation.de for de
            hint = f"; did you mean '{nested[0]}'?" if len(nested) == 1 else ""
            raise DataError(f"{key}: field '{name}' not in the dataset (fields: {', '.join(flat.column_names)}){hint}")
        feature = flat.features[name]
        if getattr(feature, "dtype", None) not in ("string", "large_string", "null"):
            raise DataError(f"{key}: field '{name}' holds {getattr(feature, 'dtype', None) or type(feature).__name__}"
                            ", not text; point it at a text field")
    columns = flat.select_columns([cfg.source, cfg.target])
    return ArrowPairs(columns, columns, cfg.source, cfg.target, where)


# ---------------------------------------------------------------------------------------------
# Tokenising (cached)
# ---------------------------------------------------------------------------------------------


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

    def __post_init__(self) -> None:
        self.src, self.tgt = (s if isinstance(s, Sequences) else Sequences.from_lists(s) for s in (self.src, self.tgt))
        if not isinstance(self.pairs, TextPairs):
            self.pairs = TextPairs.from_pairs(self.pairs)

    def __len__(self) -> int:
        return len(self.src)

    def signature(self) -> str:
        """A digest of the token ids: equal for the same pairs tokenised alike, wherever they are read."""
        digest = hashlib.sha256()
        for part in (self.src.ids, self.src.offsets, self.tgt.ids, self.tgt.offsets):
            digest.update(part.contiguous().numpy())
        return digest.hexdigest()[:16]


def data_fingerprint(cfg: DataConfig, split: str, *extra: Any) -> str:
    """A key that changes when the data, its selection or its processing changes."""
    settings = {k: v for k, v in vars(cfg).items() if k not in TRAINING_ONLY}
    spec: dict[str, Any] = {"split": split, "extra": extra, "cfg": settings}
    files = cfg.data_files.get(split, []) if cfg.data_files else []
    files = [files] if isinstance(files, str) else files
    paths = [Path(p) for p in files] + ([Path(cfg.dataset)] if not cfg.data_files and cfg.dataset else [])
    spec["stat"] = [_stat(p) for p in paths]
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _stat(path: Path) -> Any:
    if path.is_dir():
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file())
    return (str(path), path.stat().st_size, path.stat().st_mtime_ns) if path.exists() else str(path)


def encode_split(pairs: Sequence[tuple[str, str]], vocab: Vocabulary, cfg: DataConfig) -> EncodedSplit:
    """Tokenise both sides a chunk at a time (``pairs``: a list, ``ArrowPairs`` or ``TextPairs``);
    drop empty pairs and drop or truncate over-long ones."""
    out = EncodedSplit([], [], [])
    limit = cfg.max_length
    src_parts, tgt_parts, text_parts = [], [], []
    for start in range(0, len(pairs), ENCODE_CHUNK):
        chunk = pairs[start:start + ENCODE_CHUNK]
        kept = [(s, t) for s, t in chunk if s.strip() and t.strip()]
        out.dropped_empty += len(chunk) - len(kept)
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


def resegment(split: EncodedSplit, vocab: Vocabulary, cfg: DataConfig) -> EncodedSplit:
    """The split's pairs segmented afresh with BPE-dropout ``cfg.bpe_dropout`` (one epoch's worth)."""
    return encode_split(split.pairs, vocab.with_dropout(cfg.bpe_dropout), cfg)


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
    workers = min(usable_cpus(), MAX_ENCODE_WORKERS) if len(pairs) >= ENCODE_IN_WORKERS else 1
    encoded = _encode_in_workers(cfg, split, vocab, len(pairs), workers) if workers > 1 \
        else encode_split(pairs, vocab, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_encoded(encoded, path)
        # read back: the cache is memory-mapped, so the processes of a node share one copy of the split
        return read_encoded(path)
    except (CheckpointError, OSError, ValueError) as exc:  # no cache costs time next run, nothing else
        notice(str(exc))
        return encoded


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
        parts = [read_encoded(p) for p in paths]
        return EncodedSplit(Sequences.concat([p.src for p in parts]), Sequences.concat([p.tgt for p in parts]),
                            TextPairs.concat([p.pairs for p in parts]),
                            **{name: sum(getattr(p, name) for p in parts) for name in _ENCODED_COUNTS})


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
_ENCODED_COUNTS = ("dropped_empty", "dropped_long", "truncated")
_ENCODED_DTYPES = {"src_ids": torch.int32, "tgt_ids": torch.int32, "text_bytes": torch.uint8}


def write_encoded(split: EncodedSplit, path: Path) -> None:
    text_bytes = split.pairs.data if split.pairs.data.numel() else torch.zeros(1, dtype=torch.uint8)  # none: 1 byte
    tensors = {"src_ids": split.src.ids, "src_offsets": split.src.offsets,
               "tgt_ids": split.tgt.ids, "tgt_offsets": split.tgt.offsets,
               "text_bytes": text_bytes, "text_offsets": split.pairs.offsets}
    metadata = {"format": str(CACHE_FORMAT), "sha256": _checksum(tensors),
                **{name: str(getattr(split, name)) for name in _ENCODED_COUNTS}}
    with replacing(path, shared=True) as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata=metadata)


def read_encoded(path: Path) -> EncodedSplit:
    """An encoded split from the cache. Raises ValueError (or OSError) for any entry not written by
    ``write_encoded`` in this format, intact."""
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
    split = EncodedSplit(Sequences(tensors["src_ids"], tensors["src_offsets"]),
                         Sequences(tensors["tgt_ids"], tensors["tgt_offsets"]),
                         TextPairs(tensors["text_bytes"], tensors["text_offsets"]),
                         **{name: int(metadata[name]) for name in _ENCODED_COUNTS})
    if len(split.tgt) != len(split) or len(split.pairs) != len(split) or split.pairs.offsets.numel() % 2 == 0:
        raise ValueError("its parts differ in length")
    return split


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in _ENCODED_TENSORS:
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy())  # the buffer itself, not a copy of it
    return digest.hexdigest()


def train_or_load_vocabulary(cfg: DataConfig, notice: Callable[[str], None] = lambda message: None) -> Vocabulary:
    """Learn BPE on the training split, or reuse one learned from the same data and settings."""
    folder = _vocabulary_folder(cfg)
    if folder.is_dir():
        try:
            return Vocabulary.load(folder)
        except CheckpointError as exc:
            notice(f"relearning the cached vocabulary: {exc}")
    pairs = read_pairs(cfg, cfg.train_split)
    vocab = Vocabulary.train(pairs, cfg.vocab_size, cfg.joint_vocab, cfg.min_frequency, cfg.lowercase,
                             cfg.bpe_max_pairs)
    folder.mkdir(parents=True, exist_ok=True)
    vocab.save(folder)
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


def worth_preparing_apart(cfg: DataConfig) -> bool:
    """Whether ``prepare_apart`` pays for this data: unless ``data.max_samples`` caps it below
    PREPARE_APART_FROM pairs."""
    return cfg.max_samples is None or cfg.max_samples >= PREPARE_APART_FROM


def prepare_apart(cfg: DataConfig, splits: Sequence[str], vocabulary: Path | None = None) -> list[str]:
    """Fill the cache in a child process: the vocabulary learned (``train_or_load_vocabulary``; or,
    given, the one in the folder ``vocabulary``) and ``splits`` encoded with it. Returns the notices
    it gave. Reading and tokenising leave libraries, buffers and a fragmented heap behind, ~170 MiB for
    Multi30k (benchmarks/README.md); a training process that then reads the cache holds none of it."""
    return _in_child(_prepare, cfg, tuple(splits), vocabulary)


def _prepare(cfg: DataConfig, splits: tuple[str, ...], vocabulary: Path | None) -> list[str]:
    notices: list[str] = []
    vocab = Vocabulary.load(vocabulary) if vocabulary else train_or_load_vocabulary(cfg, notices.append)
    for split in splits:
        load_encoded(cfg, split, vocab, notices.append)
    return notices


def _in_child(function: Callable, *args: Any) -> Any:
    """``function(*args)`` in a spawned process: what it returns, or what it raises raised here. A
    signal here (``Interrupted``) stops the child as well; a child that dies without answering (killed,
    out of memory) is a DataError."""
    from multiprocessing import get_context

    context = get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(send, function, args))  # not a daemon: it may spawn encoders
    child.start()
    send.close()
    try:
        returned, value = receive.recv()
    except EOFError:
        child.join()
        cause = "killed: out of memory?" if (child.exitcode or 0) < 0 else "its error is above"
        raise DataError(f"preparing the data failed: its process ended with exit code {child.exitcode} "
                        f"({cause})") from None
    except BaseException:
        child.terminate()  # it unwinds (_answer)
        raise
    finally:
        child.join()
        receive.close()
    if not returned:
        raise value
    return value


def _answer(send, function: Callable, args: tuple) -> None:
    """In the child: run, and send back what came of it. Stopped by the parent (SIGTERM) or by Ctrl-C,
    it unwinds and exits as Python does, releasing what it made, instead of dying with it held."""
    signal.signal(signal.SIGTERM, _unwind)
    try:
        answer = (True, function(*args))
    except BaseException as exc:  # noqa: BLE001 - raised again in the parent
        answer = (False, exc)
    for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal would interrupt the unwinding
        signal.signal(signum, signal.SIG_IGN)
    try:
        send.send(answer)
    except OSError:  # the parent has stopped waiting: it was stopped itself
        pass
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its first line
        send.send((False, DataError(first_line(answer[1]))))


def _unwind(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


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
        src, tgt_in, tgt_out, real = ((t.pin_memory() if pin else t).to(device, non_blocking=True)
                                      for t in (self.src, self.tgt_in, self.tgt_out, self.real))
        return Batch(src, tgt_in, tgt_out, self.indices, real)


def token_batches(src_lengths: list[int], tgt_lengths: list[int], max_tokens: int, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, rank: int = 0, world_size: int = 1, multiple: int = 1) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens (on the longer side).

    Examples are sorted by length (ties broken randomly per epoch) so each batch holds similar lengths
    and padding stays small; the batch order is then shuffled from (seed, epoch). A batch into which
    ``multiple`` examples or more fit holds a multiple of ``multiple`` (the rest start the next batch),
    as fairseq's ``--required-batch-size-multiple``: its products then have row counts (sentences x
    positions) from a smaller set, which on CPUs means fewer kernels for oneDNN to build and keep
    (benchmarks/README.md, "Memory in real training"). With ``rank`` and
    ``world_size``, each process takes every world_size-th batch, all the same number (the last
    len % world_size batches of the epoch's order are left out), so the processes step together.
    Sorting is vectorised and each batch's end found by bisection, so that millions of examples take seconds.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    lengths = torch.maximum(torch.as_tensor(src_lengths, dtype=torch.float64),
                            torch.as_tensor(tgt_lengths, dtype=torch.float64))  # (n,)
    if shuffle:  # noise in [0, 1) orders equal lengths at random, never across lengths
        lengths += torch.rand(lengths.shape, generator=generator, dtype=torch.float64)
    order = torch.argsort(lengths, stable=True)
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
