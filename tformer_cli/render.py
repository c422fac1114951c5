"""Presentation: Rich tables and progress for people, plain JSON for scripts.

Library modules return data; this module turns it into output. matplotlib is imported lazily.
"""

from __future__ import annotations

import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tformer_cli.files import json_text

# No markup: what is printed is printed as it is (a path or a sentence may hold "[bold]" or "[/]"); styles
# come as Text. Soft wrap: a printed line stays one line, a long path whole (tables still fit the width),
# and in a log file an event is one line, however long.
console = Console(markup=False, soft_wrap=True)
err_console = Console(stderr=True, markup=False, soft_wrap=True)


def print_json(data: Any) -> None:
    """One JSON document on stdout, nothing else (for scripts and Makefiles); strict JSON, NaN as null."""
    sys.stdout.write(json_text(data, ascii_only=False) + "\n")
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
        table.add_row(row["component"], f"{row['per_layer']:,}", str(row["layers"]), f"{row['formula']:,}",
                      f"{row['model']:,}", _agreement(row["agrees"]))
    totals = summary["totals"]
    table.add_section()
    table.add_row("encoder total", "", "", "", f"{totals['encoder']:,}", "")
    table.add_row("decoder total", "", "", "", f"{totals['decoder']:,}", "")
    table.add_row("model total", "", "", f"{totals['formula']:,}", f"{totals['model']:,}",
                  _agreement(totals["formula"] == totals["model"]), style="bold")
    table.add_row("", "", "", "", human(totals["model"]), "", style="bold")
    console.print(table)

    mem = summary["memory_bytes"]
    notes = Table.grid(padding=(0, 2))
    notes.add_column(style="dim")
    notes.add_column()
    notes.add_row("paper's rule per encoder layer (4·d² + 2·d·d_ff)", f"{summary['paper_layer_params']:,}")
    notes.add_row("training FLOPs per target token (6 × matmul weights)",
                  human(summary["train_flops_per_token"], "FLOP"))
    notes.add_row("weights fp32 / bf16", f"{human_bytes(mem['weights_fp32'])} / {human_bytes(mem['weights_bf16'])}")
    notes.add_row("weights + grads + Adam, fp32 / bf16 mixed",
                  f"{human_bytes(mem['adam_training_fp32'])} / {human_bytes(mem['adam_training_bf16'])}")
    if mem["positional_tables"]:
        notes.add_row("positional tables (max_len rows), while built", human_bytes(mem["positional_tables"]))
    console.print(notes)


def _agreement(agrees: bool) -> Text:
    return Text("✓", style="green") if agrees else Text("✗", style="red")


def error_lines(message: str) -> None:
    """Each line of a TformerError as one red 'error:' line on stderr (no markup interpreted)."""
    for line in message.splitlines() or [message]:
        err_console.print(Text.assemble(("error: ", "bold red"), (line, "red")))


class TrainProgress:
    """A ``train`` callback: a live line in a terminal (steps, loss, lr, tokens/s, MFU, memory, time
    left) or a line per logged step elsewhere, validation lines and a summary; ``quiet``: warnings only."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.progress = None
        self.task = None

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        if self.quiet and event != "warning":  # quiet: no progress, but a warning is not progress
            return
        getattr(self, f"_on_{event}", lambda d: None)(data)

    def _on_setup(self, data: dict[str, Any]) -> None:
        err_console.print(f"{data['message']}…", style="dim")

    def _on_warning(self, data: dict[str, Any]) -> None:
        warn(data["message"])

    def _on_start(self, data: dict[str, Any]) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.table import Column

        resumed = f", resumed at step {data['resumed_at']:,}" if data["resumed_at"] else ""
        dropped = data["dropped_long"] + data["dropped_empty"]
        device = f"{data['device']} ({data['processes']} processes)" if data["processes"] > 1 else data["device"]
        if data["precision"] != "fp32":
            device += f" in {data['precision']}"
        err_console.print(
            Text.assemble(("training", "bold"), f" {data['run_dir']} on {device}{resumed}: "
            f"{human(data['parameters'])} parameters, "
            f"vocabulary {data['vocab_size']:,}, {data['train_pairs']:,} training pairs "
            f"({dropped:,} dropped: {data['dropped_long']:,} too long, {data['dropped_empty']:,} empty; "
            f"{data['truncated']:,} truncated), {data['validation_pairs']:,} validation, "
            f"{data['steps_per_epoch']:,} steps an epoch"
            + (f" of {data['batches_per_step']} batches a process" if data["batches_per_step"] > 1 else "")))
        if data["compiled"]:  # minutes without a step otherwise look like a hang
            err_console.print("compiling the model (train.compile): the first steps take a few minutes; "
                              "--set train.compile=false starts at once, uncompiled", highlight=False)
        if not err_console.is_terminal:  # a log file or pipe: plain lines instead of a live display
            return
        # One line that fits 80 columns at 100,000 steps: the bar takes what the figures leave (the
        # epoch, perplexity and elapsed time are in the log lines and the summary)
        whole = dict(table_column=Column(no_wrap=True))
        self.progress = Progress(
            BarColumn(bar_width=None, table_column=Column(ratio=1)), MofNCompleteColumn(**whole),
            TextColumn("loss {task.fields[loss]} lr {task.fields[lr]} {task.fields[speed]} tok/s"
                       "{task.fields[mfu]}{task.fields[memory]}", **whole),
            TextColumn("ETA", **whole), TimeRemainingColumn(**whole), console=err_console)
        self.progress.start()
        self.task = self.progress.add_task("train", total=data["total_steps"], completed=data["resumed_at"],
                                           loss="–", lr="–", speed="–", mfu="", memory="")

    def _on_step(self, data: dict[str, Any]) -> None:
        mfu = f" MFU {data['mfu']:.2f}" if "mfu" in data else ""
        used = data.get("gpu_peak_mib", data.get("rss_mib"))  # the device's memory: a GPU's peak, else resident
        memory = f" {used / 1024:,.1f} GiB" if used is not None else ""
        if self.progress is None:
            total = f"/{data['total_steps']:,}" if data["total_steps"] else ""
            err_console.print(f"step {data['step']:,}{total} epoch {data['epoch']} loss {data['loss']:.4f} "
                              f"ppl {data['ppl']:.2f} lr {data['lr']:.2e} {data['tokens_per_s']:,.0f} tok/s{mfu}"
                              f"{memory} {data['elapsed']:.0f} s", highlight=False)
            return
        self.progress.update(self.task, completed=data["step"], loss=f"{data['loss']:.3f}", lr=f"{data['lr']:.1e}",
                             speed=f"{data['tokens_per_s']:,.0f}", mfu=mfu, memory=memory)

    def _on_eval(self, data: dict[str, Any]) -> None:
        extra = "".join(f" · {k} {data[k]:.2f}" for k in ("bleu", "chrf", "exact_match") if k in data)
        star = (" ★ best", "green") if data["best"] else ""
        err_console.print(Text.assemble(f"step {data['step']:,}: validation loss {data['loss']:.4f} · "
                                        f"ppl {data['ppl']:.2f}{extra}", star))

    def close(self) -> None:
        """Stop the live display: at the end, and when training stops on an error (printed below it)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def _on_end(self, data: dict[str, Any]) -> None:
        """The closing table, from the run's summary (``TrainResult.summary``, what --json prints)."""
        self.close()
        err_console.print(f"training finished: {data['stop_reason']}")  # a line of its own: a table's title folds
        table = Table(box=box.SIMPLE_HEAD)
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_row("steps", f"{data['step']:,}")
        table.add_row("epochs completed", f"{data['epoch']:,}")
        table.add_row("target tokens", f"{data['target_tokens']:,}")
        table.add_row("time", f"{data['elapsed']:.1f} s")
        table.add_row("target tokens / s", f"{data['tokens_per_s'] or 0:,.0f}")
        last = data.get("last_eval")
        if last:
            table.add_row("validation loss / ppl", f"{last['loss']:.4f} / {last['ppl']:.2f}")
            for key in ("bleu", "chrf", "exact_match"):
                if key in last:
                    table.add_row(f"validation {key.replace('_', ' ')}", f"{last[key]:.2f}")
        if data["best_step"] is not None:
            table.add_row("best step", f"{data['best_step']:,}")
        err_console.print(table)


def warn(message: str) -> None:
    err_console.print(Text.assemble(("warning: ", "bold yellow"), message))


def eval_table(result: dict[str, Any]) -> None:
    search = f"beam {result['beam_size']}"
    if result.get("mbr"):
        candidates = "samples" if result["mbr_candidates"] == "sample" else "beam hypotheses"
        search = f"MBR over {result['mbr']} {candidates} ({result['mbr_metric']})"
    models = f" + {len(result['ensemble']) - 1} more (ensemble)" if result.get("ensemble") else ""
    precision = f" · {result['precision']}" if result.get("precision", "fp32") != "fp32" else ""
    # a line of its own, as in _on_end
    console.print(f"{result['run']}{models} · {result['split']} · {search}{precision}")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("sentences", f"{result['sentences']:,}"), ("loss (nats/token)", f"{result['loss']:.4f}"),
            ("perplexity", f"{result['perplexity']:.3f}"), ("BLEU", f"{result['bleu']:.2f}"),
            ("BLEU, lowercased", f"{result['bleu_lowercase']:.2f}"), ("chrF", f"{result['chrf']:.2f}"),
            ("exact match", f"{result['exact_match']:.2f} %"),
            ("sentences / s", f"{result['sentences_per_s']:,.1f}"), ("tokens / s", f"{result['tokens_per_s']:,.0f}")]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"sacreBLEU {result['bleu_signature']}", style="dim", highlight=False)


def generation_lines(result, as_json: bool, number: int = 0, align_vocab=None) -> None:
    """One line per input: the best output (n-best tab-separated), or one JSON object. With
    ``align_vocab`` (the run's vocabulary, under --align), the best output's alignment follows on a
    line of fairseq's form, A-NUMBER then source-output token position pairs (0-based, subword
    tokens); in JSON, every output's alignment and the tokens its positions count."""
    hyps = [hyp for _, hyp in result.outputs]
    if as_json:
        record = {"input": result.source, "outputs": [text for text, _ in result.outputs],
                  "scores": [round(hyp.score, 4) for hyp in hyps],  # log-probabilities
                  "normalized_scores": [round(hyp.normalized, 4) for hyp in hyps], "truncated": result.truncated}
        if result.utilities is not None:
            record["mbr_utilities"] = [round(u, 4) for u in result.utilities]
        if align_vocab is not None:
            record["source_tokens"] = align_vocab.source_tokens(align_vocab.encode_sources([result.source])[0][:-1])
            record["output_tokens"] = [align_vocab.target_tokens(hyp.tokens) for hyp in hyps]
            record["alignments"] = [_pairs(hyp) for hyp in hyps]
        print_json(record)
    else:
        sys.stdout.write("\t".join(text for text, _ in result.outputs) + "\n")
        if align_vocab is not None:
            sys.stdout.write(f"A-{number}\t" + " ".join(f"{s}-{t}" for s, t in _pairs(hyps[0])) + "\n")
        sys.stdout.flush()


def _pairs(hypothesis) -> list[tuple[int, int]]:
    """(source position, output position) for each output token of an aligned hypothesis."""
    return [(s, t) for t, s in enumerate(hypothesis.alignment or [])]
