"""TensorBoard logging (``train.tensorboard: true``): the figures of metrics.jsonl as scalars in
RUN/tensorboard/, written by ``torch.utils.tensorboard`` (the `tensorboard` extra).

    tensorboard --logdir runs/      # every run's curves side by side
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tformer_cli.errors import UsageError
from tformer_cli.run_folder import TENSORBOARD
# (split, key in the record) -> the scalar's tag
SCALARS = {
    ("train", "loss"): "train/loss", ("train", "ppl"): "train/perplexity", ("train", "lr"): "train/learning_rate",
    ("train", "tokens_per_s"): "train/tokens_per_s", ("train", "tflops"): "train/tflops", ("train", "mfu"): "train/mfu",
    ("train", "gpu_peak_mib"): "train/gpu_peak_mib", ("train", "rss_mib"): "train/rss_mib",
    ("validation", "loss"): "validation/loss", ("validation", "ppl"): "validation/perplexity",
    ("validation", "bleu"): "validation/bleu", ("validation", "chrf"): "validation/chrf",
}


def check_available() -> None:
    """train.tensorboard needs the tensorboard package: a one-line error before training starts."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError("train.tensorboard: the tensorboard package is not installed; pip install "
                         "'tformer[tensorboard]' (or set train.tensorboard=false)")


class TensorBoard:
    """Writes each metrics record as scalars at its step. A resumed run purges what was logged from
    ``purge_step`` on (the steps after its checkpoint), as metrics.jsonl does, so that the steps it
    repeats are not drawn twice."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD), purge_step=purge_step)

    def write(self, split: str, record: dict[str, Any]) -> None:
        for (kind, key), tag in SCALARS.items():
            if kind == split and record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
