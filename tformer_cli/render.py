"""Presentation: Rich tables and progress for people, plain JSON for scripts.

Library modules return data; this module turns it into output. matplotlib is imported lazily.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """One JSON document on stdout, nothing else (for scripts and Makefiles)."""
    sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M'."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def human_bytes(n: float) -> str:
    for factor, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= factor:
            return f"{n / factor:.2f} {suffix}"
    return f"{n:.0f} B"


def param_table(summary: dict) -> None:
    """count-params: one row per component, formula vs. model, totals and estimates."""
    cfg = summary["config"]
    title = (f"d_model {cfg['d_model']} · heads {cfg['num_heads']} · layers {cfg['num_encoder_layers']}+"
             f"{cfg['num_decoder_layers']} · d_ff {cfg['d_ff']} · vocab {cfg['src_vocab_size']}"
             + ("" if cfg["tgt_vocab_size"] == cfg["src_vocab_size"] else f"/{cfg['tgt_vocab_size']}")
             + f" · share {cfg['share_embeddings']} · {cfg['norm']}-LN")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    widest = len(f"{summary['totals']['model']:,}")  # numbers are never truncated; labels may wrap
    table.add_column("component", ratio=1)
    table.add_column("each", justify="right", min_width=widest, no_wrap=True)
    table.add_column("×", justify="right", no_wrap=True)
    table.add_column("formula", justify="right", min_width=widest, no_wrap=True)
    table.add_column("model", justify="right", min_width=widest, no_wrap=True)
    table.add_column("", justify="center")
    for row in summary["rows"]:
        mark = "[green]✓[/]" if row["agrees"] else "[red]✗[/]"
        table.add_row(row["component"], f"{row['per_layer']:,}", str(row["layers"]), f"{row['formula']:,}",
                      f"{row['model']:,}", mark)
    totals = summary["totals"]
    table.add_section()
    table.add_row("encoder total", "", "", "", f"{totals['encoder']:,}", "")
    table.add_row("decoder total", "", "", "", f"{totals['decoder']:,}", "")
    agrees = "[green]✓[/]" if totals["formula"] == totals["model"] else "[red]✗[/]"
    table.add_row("[bold]model total[/]", "", "", f"[bold]{totals['formula']:,}[/]",
                  f"[bold]{totals['model']:,}[/]", agrees)
    table.add_row("", "", "", "", f"[bold]{human(totals['model'])}[/]", "")
    console.print(table)

    mem = summary["memory_bytes"]
    notes = Table.grid(padding=(0, 2))
    notes.add_column(style="dim")
    notes.add_column()
    notes.add_row("paper's rule per encoder layer (4·d² + 2·d·d_ff)", f"{summary['paper_layer_params']:,}")
    notes.add_row("training FLOPs per target token (6 × matmul weights)", human(summary["train_flops_per_token"], "FLOP"))
    notes.add_row("weights fp32 / bf16", f"{human_bytes(mem['weights_fp32'])} / {human_bytes(mem['weights_bf16'])}")
    notes.add_row("weights + grads + Adam, fp32 / bf16 mixed",
                  f"{human_bytes(mem['adam_training_fp32'])} / {human_bytes(mem['adam_training_bf16'])}")
    console.print(notes)


def fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def error_lines(message: str) -> None:
    """Each line of a TformerError as one red 'error:' line on stderr (no markup interpreted)."""
    from rich.text import Text

    for line in message.splitlines() or [message]:
        err_console.print(Text.assemble(("error: ", "bold red"), (line, "red")), soft_wrap=True)
