"""Where the data is, before anything reads it: local paths made absolute, glob patterns replaced by
the files they match, the format a file's name says, and what tells one version of local data from
another (for the caches' keys). Imports neither ``datasets`` nor the hub.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from tformer_cli.config import DataConfig
from tformer_cli.errors import DataError

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".txt": "text"}


def format_of_name(path: str | Path) -> str | None:
    """The format a data file's extension names (train.jsonl.gz: json), or None (README.md, train.de)."""
    return FORMATS.get(Path(str(path).removesuffix(".gz")).suffix)


def absolute_paths(cfg: DataConfig) -> DataConfig:
    """``cfg`` with the local dataset folder and data files that exist made absolute, so that a run
    folder's config finds its data from any directory (``tformer eval runs/x`` run elsewhere), and each
    glob pattern of data files (``train-*.jsonl``, as ``datasets`` takes them) replaced by the files it
    matches, sorted: the run records what it read. Hub ids and missing paths stay as written."""
    def absolute(path: Any) -> Any:
        if isinstance(path, list):
            return [absolute(p) for p in path]
        local = Path(path).expanduser() if isinstance(path, str) else None
        return str(local.resolve()) if local is not None and local.exists() else path

    def matched(files: Any) -> Any:
        if isinstance(files, str) and not is_pattern(files):
            return absolute(files)
        return absolute(data_file_names(files, cfg.format))

    files = {split: matched(f) for split, f in cfg.data_files.items()} if cfg.data_files else cfg.data_files
    return replace(cfg, dataset=absolute(cfg.dataset), data_files=files)


def is_local_name(name: str) -> bool:
    """A dataset folder's name, not a hub id (owner/name)."""
    return Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~"))


def data_file_names(files: str | list[str], fmt: str, option: str = "data.data_files") -> list[str]:
    """A split's data files as a list, each glob pattern (``train-*.jsonl``, ``shards/**/*.jsonl``)
    replaced by the files it matches, sorted; a pattern that matches none stays, for the error that
    names it. ``fmt``: data.format; ``option``: where the names came from, for that error.

    Raises:
        DataError: a pattern matches plain-text files (train.de, train.en): a text split is a [source,
            target] pair in that order, which sorting by name would not keep.
    """
    names = []
    for name in [files] if isinstance(files, str) else files:
        matches = glob.glob(os.path.expanduser(name), recursive=True) if is_pattern(name) else []
        matches = sorted(f for f in matches if os.path.isfile(f))
        if matches and (fmt == "text" or (fmt == "auto" and format_of_name(matches[0]) in (None, "text"))):
            raise DataError(f"{option}: {name} matches plain-text files ({', '.join(matches[:2])}"
                            f"{', ...' if len(matches) > 2 else ''}), whose order says which is the source; "
                            "name them one by one, [source, target]")
        names += matches or [name]
    return names


def has_glob(text: str) -> bool:
    """Whether ``text`` holds a character that glob (and so ``datasets``) reads as a pattern."""
    return any(c in text for c in "*?[")


def is_pattern(name: Any) -> bool:
    """A glob pattern, not a file's own name (which may hold brackets)."""
    return isinstance(name, str) and has_glob(name) and not Path(name).expanduser().exists()


def local_sources(cfg: DataConfig) -> list[Path]:
    """The local data files, or the local dataset folder, that ``cfg``'s splits are read from (none
    for a hub dataset), resolved."""
    if cfg.data_files:
        return [Path(f).expanduser().resolve() for files in cfg.data_files.values()
                for f in data_file_names(files, cfg.format)]
    folder = Path(cfg.dataset).expanduser() if cfg.dataset else None
    return [folder.resolve()] if folder is not None and folder.is_dir() else []


def not_a_data_file(path: Path | str) -> str | None:
    """What keeps ``path`` from being read as a data file, or None: datasets reads its files by name,
    more than once, so a pipe (``<(zcat f.gz)``) will not do."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a folder; name its files"
    if path.exists():
        return "is not a regular file (a pipe, say); write the data to a file first (.gz files are read as they are)"
    if re.match(r"[A-Za-z][\w+.-]+:/", str(path)):  # https://, hf://, s3:// (a Path keeps one slash)
        return ("is a URL, and data files are read from local disk; download it first, or name a hub dataset "
                "in data.dataset")
    return "no file matches the pattern" if is_pattern(str(path)) else "no such file"


def file_versions(path: Path | str) -> Any:
    """What tells one version of local data from another: (path, size, time of change in ns) of a file,
    or of each file in a folder; the path alone where there is nothing."""
    path = Path(path)
    if path.is_dir():
        return sorted(file_versions(file) for file in path.rglob("*") if file.is_file())
    try:
        stat = path.stat()
    except OSError:
        return str(path)
    return str(path), stat.st_size, stat.st_mtime_ns


def version_name(paths: list[str]) -> str:
    """A name that changes with the size or the time of change of the local files (or folder) ``paths``:
    the ``datasets`` config name of data files, and the cache folder of a dataset folder. ``datasets``
    keys its cache of a local file by the time of change alone, which a file rewritten within one tick
    of the clock (or one second, on some file systems) keeps: it gave back the earlier table. With the
    size in the name too, a file that changed length is read again."""
    return "tformer-" + hashlib.sha256(repr([file_versions(p) for p in paths]).encode()).hexdigest()[:16]
