"""BPE-dropout (``data.bpe_dropout``): the training split segmented afresh for each epoch.

tokenizers draws the merges it drops from a generator that no seed reaches, so an epoch's segmentation
cannot be drawn twice alike. It is kept instead: in each checkpoint made during the epoch (one file,
hard-linked from checkpoint to checkpoint), and a resumed run goes on over the segmentation it stopped
in, as a run never stopped would. With several processes each draws a share of the pairs and all take
the shares joined. Training on a GPU, the next epoch's segmentation is drawn on the host while this
epoch trains, so that the device does not wait for it at the epoch's end.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from tformer_cli.config import DataConfig
from tformer_cli.encoding import (
    ENCODED_COUNTS, EncodedSplit, joined, read_encoded, resegment, save_encoded, split_counts, split_from_tensors,
    split_tensors)
from tformer_cli.errors import CheckpointError
from tformer_cli.parallel import Workers
from tformer_cli.run_folder import SEGMENTATION
from tformer_cli.tokenizer import Vocabulary


def draws_ahead(device: torch.device) -> bool:
    """Whether the next epoch's segmentation is drawn while this one trains: on GPUs, whose host is
    otherwise idle (on a CPU the draw would take the cores that training uses)."""
    return device.type == "cuda"


class Segmentation:
    """One epoch's segmentation of the training split, and the checkpoint file that holds it (if any)."""

    def __init__(self, epoch: int, split: EncodedSplit, file: Path | None = None) -> None:
        self.epoch, self.split, self.file = epoch, split, file

    def store(self, checkpoint: Path) -> None:
        """Into ``checkpoint``, a checkpoint folder being written: a hard link to the last checkpoint's
        copy where there is one, else the split written out (``note_stored`` then names the new copy)."""
        path = checkpoint / SEGMENTATION
        if self.file is not None:
            try:
                os.link(self.file, path)
                return
            except OSError:  # deleted since, or a file system without hard links
                pass
        save_encoded(self.split, path)

    def note_stored(self, checkpoint: Path) -> None:
        self.file = checkpoint / SEGMENTATION


def read_segmentation(checkpoint: Path, epoch: int) -> Segmentation | None:
    """The segmentation that ``checkpoint`` (of epoch ``epoch``) was trained on; None for a checkpoint
    without one (trained without BPE-dropout, or by a tformer that did not keep them)."""
    path = checkpoint / SEGMENTATION
    if not path.is_file():
        return None
    try:
        return Segmentation(epoch, read_encoded(path), path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable segmentation ({exc}); resume from an earlier checkpoint by "
                              "deleting this one") from None


class Segmentations:
    """Each epoch's segmentation of ``train_data``, in turn, the same on every process: ``resumed``,
    a checkpoint's, serves its own epoch; ``ahead``: each draw starts as the epoch before it begins.
    Each process draws its share of the pairs (one draw of a WMT-sized split holds ~33 s of Python)."""

    def __init__(self, train_data: EncodedSplit, vocab: Vocabulary, cfg: DataConfig, workers: Workers,
                 ahead: bool, resumed: Segmentation | None = None) -> None:
        share = (workers.rank, workers.size)
        self._draw: Callable[[], EncodedSplit] = lambda: resegment(train_data, vocab, cfg, share)
        self._workers, self._ahead, self._resumed = workers, ahead, resumed
        self._drawing: _Drawing | None = None

    def of_epoch(self, epoch: int) -> Segmentation:
        if self._resumed is not None and self._resumed.epoch == epoch:
            found, self._resumed = self._resumed, None
        else:
            share = self._drawing.result() if self._drawing is not None else self._draw()
            found = Segmentation(epoch, _shares_joined(self._workers, share))
        if self._ahead:
            self._drawing = _Drawing(self._draw)
        return found


def _shares_joined(workers: Workers, share: EncodedSplit) -> EncodedSplit:
    """Every process's ``share`` of a draw, joined in rank order (the split's order) on every process.
    The tensors are sent as they are: pickled, a split of a million pairs took 2.2-5.2 s between two
    processes on 2 cores, as tensors 0.27-0.30 s (benchmarks/README.md)."""
    if workers.size == 1:
        return share
    return joined([_share_from_tensors(part) for part in workers.tensors_from_each(_share_tensors(share))])


def _share_tensors(share: EncodedSplit) -> dict[str, torch.Tensor]:
    """A share as the tensors that carry it to the other processes, its counts among them."""
    return {**split_tensors(share), "counts": torch.tensor(list(split_counts(share).values()))}


def _share_from_tensors(tensors: dict[str, torch.Tensor]) -> EncodedSplit:
    return split_from_tensors(tensors, dict(zip(ENCODED_COUNTS, tensors["counts"].tolist())))


class _Drawing:
    """A draw on a thread of its own, beside training: tokenizers releases the GIL while it encodes, and
    the Python around it takes the GIL in slices of ~5-15 ms. A daemon: a run that stops does not wait
    for a draw it will not use."""

    def __init__(self, draw: Callable[[], EncodedSplit]) -> None:
        self._split: EncodedSplit | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(draw,), name="tformer-bpe-dropout", daemon=True)
        self._thread.start()

    def _run(self, draw: Callable[[], EncodedSplit]) -> None:
        # A draw's millions of short-lived lists set off full collections, each walking the whole heap
        # with the GIL held: ~0.1 s each, two or three a draw of Multi30k, the training loop stalled.
        # Frozen, what existed before the draw is left out of them (benchmarks/README.md).
        gc.freeze()
        try:
            self._split = draw()
        except BaseException as exc:  # raised again where the draw is taken
            self._error = exc
        finally:
            gc.unfreeze()

    def result(self) -> EncodedSplit:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._split
