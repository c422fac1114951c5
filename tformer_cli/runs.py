"""Run folders for ``tformer train``: the config of a new or resumed run, what a resume may change, and
how a signal stops a run so that it resumes exactly.

A new run refuses to replace an old one unless told (``--overwrite``), and never deletes a folder
that tformer did not make or a file it did not write (``run_folder.py``); a resumed run keeps its
model's shape and its vocabulary.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tformer_cli.config import Config, load_config
from tformer_cli.data import check_local_data, pin_revision
from tformer_cli.data_paths import absolute_paths
from tformer_cli.errors import CheckpointError, Interrupted, UsageError
from tformer_cli.run_folder import (
    CONFIG, MARKER, WEIGHTS, check_not_held, foreign_files, is_marked, start_again, step_checkpoints)


def prepare_run(config_path: Path | None, resume: Path | None, overrides: list[str], output_dir: Path | None,
                overwrite: bool = False, main: bool = True, device: str | None = None) -> tuple[Config, Path]:
    """The config and run folder for a new run or a resumed one (checked and cleared by the ``main``
    process only, when several train together), on ``device`` if given (else train.device).

    Raises:
        UsageError: neither or both of config and resume, a device that is not there (checked before
            anything is cleared), or a new run would overwrite an old one.
        CheckpointError: ``resume`` is not a run folder that ``tformer train`` started.
        DataError: a local dataset folder or data file that is not there (``check_local_data``).
    """
    if (config_path is None) == (resume is None):
        raise UsageError("give either a CONFIG to start a run or --resume RUN_FOLDER to continue one")
    if resume is not None:
        if not (Path(resume) / CONFIG).is_file():
            raise CheckpointError(f"--resume {resume}: not a run folder (no config.yaml)")
        if not is_marked(resume) and not step_checkpoints(resume):  # a user's folder, or an average's
            raise CheckpointError(f"--resume {resume}: not a run that tformer train started (no {MARKER} marker, "
                                  f"no checkpoint); start one from its config: tformer train "
                                  f"{Path(resume) / CONFIG} --output-dir NEW_FOLDER")
        config = _resumed_config(Path(resume) / CONFIG, overrides)
        config.name, run_dir = Path(resume).name, Path(resume)
    else:
        config = load_config(config_path, overrides)
        run_dir = Path(output_dir or config.train.output_dir or Path("runs") / config.name)
    config.train.device = device or config.train.device  # recorded in the run's config.yaml
    check_local_data(config.data, [split for split in (config.data.train_split, config.data.validation_split) if split])
    from tformer_cli.devices import resolve_device  # torch loads here (seconds): after the checks that need none

    resolve_device(config.train.device, "--device" if device else "train.device")
    if resume is None and main:
        _clear_for_new_run(run_dir, overwrite)
    config.data = absolute_paths(config.data)  # the run's config.yaml then works from any directory
    if main:  # and names the hub dataset's commit it reads (the other processes take it from this one)
        config.data = pin_revision(config.data)
    return config, run_dir


def _clear_for_new_run(run_dir: Path, overwrite: bool) -> None:
    """Make way for a new run in ``run_dir``, deleting only what tformer wrote there: a run that has
    weights only with ``overwrite``; a start that never reached its first checkpoint (killed during
    setup, say) without asking, as it holds nothing that a resume could use."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise UsageError(f"--output-dir {run_dir}: a link to {run_dir.readlink()}, which does not exist; create "
                         "that folder or pick another --output-dir")
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UsageError(f"--output-dir {run_dir}: is a file; pick a folder")
    if not any(run_dir.iterdir()):
        return
    if not is_marked(run_dir):
        raise UsageError(f"{run_dir} is not empty and holds no tformer run (no {MARKER} marker); pick a new or "
                         "empty --output-dir")
    foreign = foreign_files(run_dir)
    if foreign:
        raise UsageError(f"{run_dir} holds files tformer did not write ({len(foreign)}, e.g. {foreign[0]}); "
                         "move them out or pick another --output-dir")
    if not overwrite and (step_checkpoints(run_dir) or (run_dir / WEIGHTS).is_file()):
        raise UsageError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, "
                         "or pass --overwrite or another --output-dir")
    check_not_held(run_dir)
    for path in run_dir.iterdir():  # the folder stays: it may be a link or a mount point someone made
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# What a resumed run may change: its regularisation, not the weights' shapes or the vocabulary it learned.
_RESUMABLE_MODEL_KEYS = ("dropout", "attention_dropout", "word_dropout")
_VOCABULARY_KEYS = ("vocab_size", "joint_vocab", "min_frequency", "lowercase")


def _resumed_config(path: Path, overrides: list[str]) -> Config:
    """A run's saved config with a resume's ``overrides``. The hub dataset's commit that the run
    recorded (data.revision) is kept unless they name other data, whose version it is not: then the
    new data is read at its own (pinned afresh, where it is a hub dataset), or at the revision they set.

    Raises:
        ConfigError: a mistake in the overrides.
        UsageError: they change the model's shape or the vocabulary.
    """
    saved = load_config(path, saved_run=True)
    if not overrides:
        return saved
    revision_set = any(item.partition("=")[0].strip() == "data.revision" for item in overrides)
    config = load_config(path, overrides if revision_set else ["data.revision=null", *overrides], saved_run=True)
    _refuse_fixed_changes(saved, config)
    same_data = all(getattr(saved.data, key) == getattr(config.data, key) for key in ("dataset", "subset", "data_files"))
    if not revision_set and same_data:
        config.data.revision = saved.data.revision
    return config


def _refuse_fixed_changes(saved: Config, config: Config) -> None:
    """UsageError when overrides on --resume change the model or the vocabulary of the run."""
    fixed = [("model", key) for key in vars(saved.model) if key not in _RESUMABLE_MODEL_KEYS]
    fixed += [("data", key) for key in _VOCABULARY_KEYS]
    for section, key in fixed:
        before, after = getattr(getattr(saved, section), key), getattr(getattr(config, section), key)
        if before != after:
            raise UsageError(f"--set {section}.{key}={after}: a resumed run keeps its {section}.{key} ({before}); "
                             "start a new run (tformer train CONFIG) to change it")


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM. During setup they stop at once (``Interrupted``); between steps the
    step under way finishes and is checkpointed first, so that the saved random state is the one the
    next step starts from and a resume continues exactly. A second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None

    @contextmanager
    def during_setup(self) -> Iterator[None]:
        with self._handling(self._stop_now):
            yield

    @contextmanager
    def between_steps(self) -> Iterator[None]:
        with self._handling(self._note):
            yield

    def _stop_now(self, signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    def _note(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signum

    @contextmanager
    def _handling(self, handler) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # Python delivers signals to it alone
            yield
            return
        previous = {signum: signal.signal(signum, handler) for signum in self.SIGNALS}
        try:
            yield
        finally:
            for signum, old in previous.items():
                signal.signal(signum, old)


def stop_message(signum: int, run_dir: Path | None) -> str:
    """What to tell a user whose training a signal stopped: the last checkpoint and the command that
    resumes from it, or, before the first checkpoint, the command that starts the run again."""
    name = signal.Signals(signum).name
    last = step_checkpoints(run_dir) if run_dir is not None else []
    if last:
        return f"stopped by {name}; checkpoint {last[-1]}; resume with: tformer train --resume {run_dir}"
    return f"stopped by {name} before the first checkpoint; start it again with: {start_again(run_dir)}"
