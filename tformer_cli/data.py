"""Parallel text through Hugging Face `datasets`: the (source, target) pairs of a split, from the hub,
a local dataset folder or data files, with one-line errors for whatever cannot be read.

``data.dataset`` is a hub id or a local dataset folder; ``data.data_files`` maps splits to files
(json/jsonl, csv, tsv, parquet, or a [source, target] pair of plain-text files; .gz allowed). The pairs are
tokenised and cached by ``encoding.py`` and batched by ``batching.py``; ``data_paths.py`` finds the files
that a config names.
"""

from __future__ import annotations

import glob
import gzip
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from tformer_cli import hub
from tformer_cli.config import DataConfig
from tformer_cli.data_paths import (data_file_names, format_of_name, has_glob, is_local_name, not_a_data_file,
                                    version_name)
from tformer_cli.errors import DataError, brief, first_line

READ_CHUNK = 100_000  # pairs made Python strings at a time, so that a split of millions never is at once


def pin_revision(cfg: DataConfig) -> DataConfig:
    """``cfg`` with a hub dataset's revision (a branch, or none: the default branch) replaced by the
    commit it is at now, so that the run's config.yaml names the version it read, and a resume, an
    eval and the cache key read that one. Local data, and a hub the run cannot reach, stay as they are."""
    if cfg.data_files or not cfg.dataset or is_local_name(cfg.dataset):
        return cfg
    return replace(cfg, revision=hub.commit_of(cfg.dataset, cfg.revision) or cfg.revision)


def check_local_data(cfg: DataConfig, splits: list[str]) -> None:
    """The mistakes in ``cfg``'s local data that reading nothing finds: a dataset folder, or a data file
    of one of ``splits``, that is not there (or is no file, or is empty). Training checks them before torch
    and the data's child process load, which takes seconds before ``read_pairs`` would say the same.

    Raises:
        DataError: as ``read_pairs`` raises it.
    """
    if cfg.data_files:
        for split in splits:
            _split_files(cfg, split)
    elif cfg.dataset and is_local_name(cfg.dataset) and not Path(cfg.dataset).expanduser().exists():
        raise _no_folder(cfg.dataset)


def _split_files(cfg: DataConfig, split: str) -> list[str]:
    """The data files of ``split`` (``data.data_files``), each checked to be there, a file, and not empty."""
    if split not in cfg.data_files:
        raise _missing_split("data.data_files", split, list(cfg.data_files), cfg)
    files = data_file_names(cfg.data_files[split], cfg.format)
    _check_files(files)
    return files


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
        files = _split_files(cfg, split)
        fmt = cfg.format if cfg.format != "auto" else _format_of(files)
    where = f"{', '.join(files) if cfg.data_files else cfg.dataset}: split '{split}'"
    try:
        if cfg.data_files:
            pairs = _file_pairs(files, fmt, cfg, where)
        else:
            pairs = _named_pairs(cfg, split, where)
    except UnicodeDecodeError as exc:
        raise _not_utf8(where, exc) from None
    if not len(pairs):
        raise DataError(f"split '{split}' of {cfg.data_files or cfg.dataset} is empty; check the files or split name")
    if cfg.max_samples:
        pairs.size = min(pairs.size, cfg.max_samples)
    return pairs


def _named_pairs(cfg: DataConfig, split: str, where: str) -> "ArrowPairs":
    """A split of a hub dataset or a local dataset folder."""
    _check_split_files(cfg.dataset, split)
    if tsv := _tsv_split(cfg.dataset, split):  # datasets' folder loader would take a first line for a header
        _check_files(tsv)
        return _tsv_pairs(tsv, cfg, where)
    splits = _load_named(cfg.dataset, cfg.subset, cfg.revision)
    if split not in splits:
        raise _missing_split(f"dataset '{cfg.dataset}'", split, list(splits), cfg)
    return _columns(splits[split], cfg, where)


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
        for start in range(0, self.size, READ_CHUNK):
            yield from self[start:start + READ_CHUNK]


def _file_pairs(files: list[str], fmt: str, cfg: DataConfig, where: str) -> ArrowPairs:
    if fmt == "text":
        return _text_pairs(files, where)
    if fmt == "tsv":
        return _tsv_pairs(files, cfg, where)
    return _columns(_load_files(fmt, files), cfg, where)


def _mixed_types(flat, name: str, key: str, where: str) -> DataError:
    """A text field with a value that is not text (a number, a list) among its texts: the first such row.
    datasets keeps such a field's values JSON-encoded, so a text value is one that starts with a quote."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pa.chunked_array([chunk.storage for chunk in flat.data.column(name).chunks], pa.string())
    text = pc.or_kleene(pc.starts_with(encoded, '"'), pc.equal(encoded, "null"))
    row = pc.index(pc.fill_null(text, True), False).as_py()  # datasets mixes types only when one is not text
    return DataError(f"{key}: field '{name}' is not all text ({where}, row {row + 1}: {encoded[row].as_py():.40}); "
                     "make every value of it a string (in JSON, in quotes)")


def _not_utf8(where: str, exc: UnicodeDecodeError) -> DataError:
    return DataError(f"{where} is not UTF-8 text (a byte {exc.object[exc.start:exc.start + 1]!r}); convert the "
                     "data to UTF-8, e.g. iconv -t UTF-8")


def _format_of(files: list[str]) -> str:
    """The format that the first file's extension names; two files without a known extension are a
    source and a target text file, named by their languages as Moses and fairseq name them (train.de,
    train.en)."""
    formats = [format_of_name(f) for f in files]
    if formats[0] is not None:
        return formats[0]
    if len(files) == 2 and not any(formats):
        return "text"
    raise DataError(f"cannot tell the format of '{files[0]}' from its extension; name it .jsonl, .csv, .tsv, .parquet "
                    "or .txt, or set data.format to json, csv, tsv, parquet or text")


_MISSING = {"no such file": "data file not found:", "no file matches the pattern": "no data file matches"}


def _check_files(files: list[str]) -> None:
    for path in files:
        problem = not_a_data_file(path)
        if problem in _MISSING:
            raise DataError(f"{_MISSING[problem]} {path}; fix data.data_files (paths are relative to the current "
                            "directory)")
        if problem:
            folder = " in data.data_files, or set data.dataset to the folder" if Path(path).is_dir() else ""
            raise DataError(f"{path}: {problem}{folder}")
        if Path(path).stat().st_size == 0:
            raise DataError(f"{path}: the file is empty; point data.data_files (or --data-files) at the data")


def _load_files(fmt: str, files: list[str], **options: Any):
    """``files`` as one ``datasets`` table, read by its ``fmt`` loader with ``options``."""
    import datasets

    datasets.disable_progress_bars()
    failed: list[str] = []
    try:
        with _datasets_errors(failed):
            names = [glob.escape(f) for f in files]  # datasets reads each name as a pattern: [draft].jsonl is a file
            return datasets.load_dataset(fmt, version_name(files), data_files={"split": names}, split="split",
                                         **options)
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
        raise DataError(f"plain-text data needs two parallel files [source, target] per split, got {brief(files)}")
    source, target = (_load_files("text", [f], encoding="utf-8-sig") for f in files)  # -sig: a byte-order mark is no text
    if len(source) != len(target):
        raise DataError(f"parallel files differ in length: {files[0]} has {len(source)} lines, "
                        f"{files[1]} has {len(target)}")
    return ArrowPairs(source, target, "text", "text", where)


def _tsv_pairs(files: list[str], cfg: DataConfig, where: str) -> ArrowPairs:
    """Tab-separated pairs, one a line: the source, a tab, the target (further columns, such as
    Tatoeba's attribution, ignored; quotes are text). A first line that names the two languages
    (``en<TAB>de``, data.source and data.target) is a header."""
    import csv

    import datasets

    names = [cfg.source, cfg.target]
    strings = datasets.Features({name: datasets.Value("string") for name in names})
    tables = []
    for file in files:
        first = _first_fields(file)
        if len(first) < 2:
            raise DataError(f"{file}: the first line has no tab; a .tsv file holds the source, a tab and the "
                            "target on each line")
        tables.append(_load_files("csv", [file], sep="\t", header=0 if first == names else None, column_names=names,
                                  usecols=[0, 1], quoting=csv.QUOTE_NONE, na_filter=False, features=strings))
    pairs = datasets.concatenate_datasets(tables)
    return ArrowPairs(pairs, pairs, cfg.source, cfg.target, where)


def _check_split_files(folder: str, split: str) -> None:
    """Refuse a local dataset folder whose files for ``split`` (as ``datasets`` assigns them) would not be
    read as they stand: a file beside its .gz copy (both read), or files named for the split in two formats
    (one left out). In a folder with no file named for a split, ``datasets`` reads the most common format
    and leaves the rest aside (notes.txt beside pairs.jsonl), as it should."""
    from datasets.data_files import DEFAULT_PATTERNS_ALL, DataFilesDict, get_data_patterns

    if not Path(folder).is_dir():
        return
    try:
        patterns = get_data_patterns(folder)
        files = DataFilesDict.from_patterns(patterns, base_path=folder).get(split, [])
    except FileNotFoundError:  # no data files in it (datasets' EmptyDatasetError): the loaders say so
        return
    twice = sorted(set(files) & {file.removesuffix(".gz") for file in files if file.endswith(".gz")})
    if twice:
        name = Path(twice[0]).name
        raise DataError(f"dataset folder '{folder}' holds both {name} and {name}.gz, which would both be read "
                        f"as split '{split}', the same pairs twice; keep one of them")
    by_format = {fmt: Path(file).name for file in files if (fmt := format_of_name(file))}  # README.md: none
    if len(by_format) > 1 and patterns != DEFAULT_PATTERNS_ALL:
        raise DataError(f"dataset folder '{folder}' holds split '{split}' in {len(by_format)} formats "
                        f"({', '.join(sorted(by_format.values()))}), of which only one would be read; keep one "
                        "format there, or choose the files with data.data_files")


def _tsv_split(folder: str, split: str) -> list[str]:
    """A local dataset folder's tab-separated file of ``split`` (SPLIT.tsv or SPLIT.tsv.gz), if it has
    one; a folder whose data is all .tsv files but has none for ``split`` is a one-line error. (A folder
    with data in other formats is ``datasets``' to read, a stray .tsv file in it left alone.)"""
    if not Path(folder).is_dir():
        return []
    found = [path for path in (Path(folder) / f"{split}.tsv", Path(folder) / f"{split}.tsv.gz") if path.is_file()]
    if found:
        return [str(found[0])]
    formats = {path.name: format_of_name(path.name) for path in Path(folder).iterdir()}
    tsv = sorted(name for name, fmt in formats.items() if fmt == "tsv")
    if tsv and set(formats.values()) <= {"tsv", None}:
        raise DataError(f"dataset folder '{folder}' has no {split}.tsv (has: {', '.join(tsv)}); add it, or set "
                        "data.train_split / validation_split / test_split to the name of its file")
    return []


def _first_fields(path: str) -> list[str]:
    """The first two tab-separated fields of a text file's first line (gzip or plain)."""
    with (gzip.open(path, "rt", encoding="utf-8-sig", errors="replace") if path.endswith(".gz")
          else open(path, encoding="utf-8-sig", errors="replace")) as f:  # -sig: a byte-order mark is not the header's
        return f.readline().rstrip("\r\n").split("\t")[:2]


def _missing_split(what: str, split: str, found: list[str], cfg: DataConfig) -> DataError:
    no_validation = " (or data.validation_split: null to train without one)" if split == cfg.validation_split else ""
    return DataError(f"{what} has no split '{split}' (has: {', '.join(found)}); add it, or name another: "
                     f"data.train_split / validation_split / test_split in training{no_validation}, --split with eval")


def _no_folder(name: str) -> DataError:
    return DataError(f"data.dataset: no such folder '{name}'; check the path (relative paths start from the current "
                     "directory), or evaluate other files with eval --data-files")


def _load_named(name: str, subset: str | None, revision: str | None):
    """The splits of a hub dataset (at ``revision``) or a local dataset folder."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(name).exists()
    if not local and is_local_name(name):
        raise _no_folder(name)
    if local and revision:
        raise DataError(f"data.revision: selects a version of a hub dataset, and '{name}' is a local folder; "
                        "remove data.revision")
    if local and has_glob(str(Path(name).resolve())):  # datasets globs under the folder's path
        raise DataError(f"data.dataset: the path of '{name}' holds one of * ? [ which datasets reads as a pattern; "
                        "rename the folder, or name its files in data.data_files")
    unreachable = None if local else hub.unreachable()
    failed: list[str] = []
    try:
        with hub.offline() if unreachable else nullcontext(), _datasets_errors(failed):
            # a folder's tables cached apart per version of its files (see version_name)
            cache = Path(datasets.config.HF_DATASETS_CACHE, "tformer", version_name([name])) if local else None
            dataset = datasets.load_dataset(name, subset, cache_dir=str(cache) if cache else None, revision=revision)
    except Exception as exc:
        if revision and not unreachable and "revision" in str(_root_cause(exc)).lower():
            raise DataError(f"data.revision: '{name}' has no revision '{revision}' ({first_line(_root_cause(exc))}); "
                            "name a branch, tag or commit of it") from exc
        wrong_subset = None if unreachable else hub.wrong_subset(name, subset, revision)
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
    return dataset


def _columns(dataset, cfg: DataConfig, where: str) -> ArrowPairs:
    import datasets

    mixed = getattr(datasets, "Json", ())  # datasets' type for a field whose values differ in type (since 5.0)
    flat = dataset.flatten()
    for key, name in (("data.source", cfg.source), ("data.target", cfg.target)):
        if name not in flat.column_names:
            nested = [f for f in flat.column_names if f.endswith("." + name)]  # e.g. translation.de for de
            hint = f"; did you mean '{nested[0]}'?" if len(nested) == 1 else ""
            raise DataError(f"{key}: field '{name}' not in the dataset (fields: {', '.join(flat.column_names)}){hint}")
        feature = flat.features[name]
        if isinstance(feature, mixed):
            raise _mixed_types(flat, name, key, where)
        if getattr(feature, "dtype", None) not in ("string", "large_string", "null"):
            raise DataError(f"{key}: field '{name}' holds {getattr(feature, 'dtype', None) or type(feature).__name__}"
                            ", not text; point it at a text field")
    columns = flat.select_columns([cfg.source, cfg.target])
    return ArrowPairs(columns, columns, cfg.source, cfg.target, where)
