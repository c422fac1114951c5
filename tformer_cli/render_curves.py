"""Learning curves from a run's metrics.jsonl: training loss, validation loss and BLEU against steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tformer_cli.files import write_figure

METRICS = {"bleu": "BLEU", "exact_match": "exact match, %", "chrf": "chrF"}


def score_to_plot(validation: list[dict[str, Any]]) -> str | None:
    """BLEU, unless it is zero throughout (one-word outputs have no 4-grams): then exact match, then chrF."""
    return next((key for key in METRICS if any(record.get(key) for record in validation)), None)


def _number(record: dict[str, Any], key: str) -> float:
    """A figure to plot; a diverged step's null (metrics.jsonl is strict JSON) leaves a gap."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def plot_curves(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    train = [r for r in records if r.get("split") == "train"]
    valid = [r for r in records if r.get("split") == "validation"]
    score = score_to_plot(valid)
    panels = 1 + (score is not None)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    loss_ax = axes[0][0]
    loss_ax.plot([r["step"] for r in train], [_number(r, "loss") for r in train], label="train (NLL)", alpha=0.6)
    loss_ax.plot([r["step"] for r in valid], [_number(r, "loss") for r in valid], "o-", label="validation")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (nats / target token)")
    loss_ax.set_yscale("log")
    # Plain numbers on the log axis; between powers of ten label 2 and 5, or 2 to 6 where under a decade shows.
    low, high = loss_ax.get_ylim()
    labelled = {2, 5} if math.log10(high / low) > 1 else {2, 3, 4, 6}
    loss_ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    loss_ax.yaxis.set_minor_formatter(
        matplotlib.ticker.FuncFormatter(
            lambda value, _: f"{value:g}" if round(value / 10 ** math.floor(math.log10(value))) in labelled else ""
        )
    )
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    if score is not None:
        ax = axes[0][1]
        points = [r for r in valid if score in r]
        ax.plot([r["step"] for r in points], [_number(r, score) for r in points], "o-", color="tab:green")
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation {METRICS[score]} (greedy)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, parse_math=False)  # a run's path is text, $ and all
    write_figure(fig, path, dpi=130)  # laid out there
    plt.close(fig)
