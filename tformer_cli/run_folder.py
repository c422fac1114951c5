"""What a run folder may hold: tformer's marker, and the files tformer writes there (see runtime.py);
where a command finds a run's checkpoints and weights (without torch, so that a mistake is said at once).

``--overwrite`` deletes a folder only when it carries the marker and holds nothing but these files,
so a mistyped ``--output-dir`` can never cost a user their own files.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from tformer_cli.errors import CheckpointError, UsageError
from tformer_cli.files import final_name, read_jsonl, write_text_atomic
from tformer_cli.tokenizer import JOINT_FILE, SOURCE_FILE, TARGET_FILE

MARKER = ".tformer-run"  # written first, when tformer creates a run folder
CONFIG = "config.yaml"  # the resolved config
WEIGHTS = "model.safetensors"  # the run's best (or latest) weights, and each checkpoint's
METRICS = "metrics.jsonl"  # every logged figure
CHECKPOINTS = "checkpoints"  # step-N/ (WEIGHTS, TRAINER, SEGMENTATION), ema/, average-*/
TRAINER = "trainer.pt"  # optimizer, step, data position, RNG state
SEGMENTATION = "segmentation.safetensors"  # under data.bpe_dropout, the epoch's segmentation of the training split
TENSORBOARD = "tensorboard"  # TensorBoard's event files, under train.tensorboard
_TOP = {MARKER, CONFIG, WEIGHTS, METRICS, JOINT_FILE, SOURCE_FILE, TARGET_FILE, "curves.png"}
_CHECKPOINT_FILES = {WEIGHTS, TRAINER, SEGMENTATION}
_AVERAGE_FOLDER = re.compile(r"average-[\w.-]+")
_CHECKPOINT_FOLDER = re.compile(rf"step-\d{{8}}|ema|{_AVERAGE_FOLDER.pattern}")
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.[\w.-]+")
_WRITERS_TEMPORARY = re.compile(r"\.tmp\w{6,}")  # safetensors' own, beside a file it was killed writing


def start_again(run_dir: Path | None) -> str:
    """The command that starts again a run stopped before its first checkpoint: once its config.yaml is
    written, a resume (which, with no checkpoint, starts afresh from it); before, the command as typed."""
    if run_dir is not None and (run_dir / CONFIG).is_file():
        return f"tformer train --resume {run_dir}"
    return shlex.join(["tformer", *sys.argv[1:]])


def mark_run_folder(run_dir: Path) -> None:
    """Create ``run_dir`` (if needed) with tformer's marker in it."""
    from tformer_cli import __version__

    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / MARKER
    if not marker.is_file():
        write_text_atomic(marker, json.dumps({"written_by": "tformer", "version": __version__}) + "\n")


def is_marked(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file()


@contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` while one process trains into it: its marker (made if needed) is locked, so
    that a second ``tformer train`` on the folder, or an ``--overwrite`` of it, stops with one line
    instead of interleaving its checkpoints and metrics with the first one's. The OS releases the lock
    when the process ends, however it ends. A folder made here that holds only the marker at the end
    (a start that failed before writing anything) is removed."""
    made, lock = not run_dir.exists(), None
    try:
        mark_run_folder(run_dir)  # a full disk may stop even this
        lock = _lock(run_dir)
        yield
    finally:
        if lock is not None:
            lock.close()
        if made and run_dir.is_dir() and {path.name for path in run_dir.iterdir()} <= {MARKER}:
            (run_dir / MARKER).unlink(missing_ok=True)
            run_dir.rmdir()


def check_not_held(run_dir: Path) -> None:
    """A UsageError if a training process holds ``run_dir`` (see ``holding``)."""
    if is_marked(run_dir):
        lock = _lock(run_dir)
        if lock is not None:
            lock.close()


def _lock(run_dir: Path) -> IO[bytes] | None:
    """The marker, opened and locked for this process; None where locks are not to be had (Windows,
    a file system without them)."""
    try:
        import fcntl
    except ImportError:
        return None
    marker = open(run_dir / MARKER, "rb")
    try:
        fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        marker.close()
        raise UsageError(f"{run_dir}: another `tformer train` is writing this run now; wait for it to end (or stop "
                         "it), or pick another --output-dir") from None
    except OSError:
        marker.close()
        return None
    return marker


def is_run_file(path: Path) -> bool:
    """Whether ``path`` is one of a run's own files (its config, weights, tokenizer, metrics, or a
    checkpoint's), which no command's output may be written over."""
    folder = Path(path).parent
    if (folder / CONFIG).is_file() or is_marked(folder):
        return path.name in _TOP
    return folder.parent.name == CHECKPOINTS and path.name in _CHECKPOINT_FILES


def is_average_folder(folder: Path, run_dir: Path) -> bool:
    """Whether ``folder`` is where an average of ``run_dir``'s checkpoints goes inside the run:
    RUN/checkpoints/average-NAME, which ``--overwrite`` and ``train.keep_last`` know as tformer's."""
    return (_AVERAGE_FOLDER.fullmatch(folder.name) is not None
            and folder.parent.resolve() == (Path(run_dir) / CHECKPOINTS).resolve())


def remove_checkpoint(folder: Path) -> None:
    """Delete a step checkpoint's own files, and the folder once it is empty: a file put there by
    someone else stays, in a folder that no longer counts as a checkpoint."""
    if folder.is_symlink():  # a link someone made: neither it nor what it points to is tformer's to delete
        return
    try:
        for path in folder.iterdir():
            if _is_own_file(path, _CHECKPOINT_FILES):
                path.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()
    except OSError:  # gone already, or not ours to change: pruning never stops training
        pass


def foreign_files(run_dir: Path) -> list[Path]:
    """Everything in ``run_dir`` that tformer does not write there (temporary files of its own
    interrupted writes count as its own), in sorted order."""
    foreign = []
    for path in sorted(run_dir.iterdir()):
        if path.name == CHECKPOINTS and path.is_dir() and not path.is_symlink():
            foreign += _foreign_checkpoints(path)
        elif path.name == TENSORBOARD and path.is_dir() and not path.is_symlink():
            foreign += [f for f in sorted(path.iterdir()) if not (_EVENT_FILE.fullmatch(f.name) and f.is_file()
                                                                  and not f.is_symlink())]
        elif not _is_own_file(path, _TOP):
            foreign.append(path)
    return foreign


def _foreign_checkpoints(folder: Path) -> list[Path]:
    foreign = []
    for checkpoint in sorted(folder.iterdir()):
        if not (_CHECKPOINT_FOLDER.fullmatch(final_name(checkpoint.name) or checkpoint.name) and checkpoint.is_dir()
                and not checkpoint.is_symlink()):
            foreign.append(checkpoint)
            continue
        foreign += [f for f in sorted(checkpoint.iterdir()) if not _is_own_file(f, _CHECKPOINT_FILES)]
    return foreign


def _is_own_file(path: Path, names: set[str]) -> bool:
    own_name = (final_name(path.name) or path.name) in names or _WRITERS_TEMPORARY.fullmatch(path.name)
    return bool(own_name) and path.is_file() and not path.is_symlink()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, a record a line."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {METRICS}; is this a run folder written by `tformer train`?")
    return read_jsonl(path)


def step_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-*") if (p / WEIGHTS).is_file() and (p / TRAINER).is_file())


def existing(path: Path | str) -> Path:
    """``path``, which a command reads a run from, where it exists.

    Raises:
        CheckpointError: nothing is there.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run folder; train one with `tformer train CONFIG`")
    return path


def find_weights(path: Path) -> tuple[Path, Path]:
    """(run folder, weights file) for a run folder, a checkpoint folder in it, or a weights file."""
    path = existing(path)
    if path.is_file():
        return run_folder_of(path.parent), path
    if (path / CONFIG).is_file():
        if (path / WEIGHTS).is_file():
            return path, path / WEIGHTS
        steps = step_checkpoints(path)
        if steps:
            return path, steps[-1] / WEIGHTS
        raise CheckpointError(f"{path}: the run has no weights yet; train it first (tformer train --resume {path})")
    if (path / WEIGHTS).is_file():
        return run_folder_of(path), path / WEIGHTS
    try:
        inside = sorted(folder.name for folder in path.iterdir() if (folder / WEIGHTS).is_file())
    except OSError:  # unreadable: said below as well as it can be
        inside = []
    if inside:
        raise CheckpointError(f"{path}: a folder of checkpoints, not one; name one of them ({', '.join(inside[-3:])}) "
                              "or the run folder")
    raise CheckpointError(f"{path}: neither a run folder nor a checkpoint (no config.yaml or {WEIGHTS})")


def run_folder_of(folder: Path) -> Path:
    """The run folder that ``folder`` is (or is a checkpoint inside)."""
    run = owning_run(folder)
    if run is None:
        raise CheckpointError(f"{folder}: not a run folder (no config.yaml), nor a checkpoint inside one; pass the "
                              "folder `tformer train` wrote, e.g. runs/demo")
    return run


def owning_run(folder: Path) -> Path | None:
    """The run folder that ``folder`` is or lies in, as eval and generate find it: ``folder``, its parent
    or theirs, the first with a config.yaml; None where there is none."""
    return next((run for run in (folder, folder.parent, folder.parent.parent) if (run / CONFIG).is_file()), None)
