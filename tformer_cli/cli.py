"""The `tformer` command line: thin commands over the library (the error boundary: cli_boundary.py).

Heavy imports (torch, datasets) happen inside command bodies so that `tformer --help` is instant.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from tformer_cli import __version__
from tformer_cli.cli_boundary import ErrorBoundary
from tformer_cli.cli_decode import eval_command, generate
from tformer_cli.cli_options import (
    ADVANCED, DecodeDeviceOpt, DeviceOpt, JsonOpt, NnodesOpt, NprocOpt, QuietOpt, RdzvOpt, RunArg, SetOpt,
    check_image_name, check_text)
from tformer_cli.errors import CheckpointError, Interrupted, UsageError
from tformer_cli.launch import (
    check_torchrun_environment, launch_training, launched, launched_rank, quieten_torch, training_group)


app = typer.Typer(
    cls=ErrorBoundary,
    help="Train, evaluate and inspect encoder-decoder Transformers (Vaswani et al. 2017).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tformer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Train, evaluate and inspect encoder-decoder Transformers (Vaswani et al. 2017)."""


@app.command()
def train(
    ctx: typer.Context,
    config: Annotated[Optional[Path], typer.Argument(help="YAML config (omit with --resume).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue the run in this folder.")] = None,
    overrides: SetOpt = None,
    device: DeviceOpt = None,
    output_dir: Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<config name>).")] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing run folder (never a folder that holds no run).")] = False,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
    rdzv_endpoint: RdzvOpt = None,
) -> None:
    """Train a model from a YAML config; checkpoints, metrics and the tokenizer go to a run folder.

    [dim]Examples:[/]
      tformer train configs/demo.yaml
      tformer train configs/small.yaml --set data.dataset=../shared/data/multi30k --device cuda
      tformer train --resume runs/demo --set train.max_steps=4000
      tformer train configs/base.yaml --nproc-per-node 4   [dim](4 GPUs)[/]
      tformer train configs/big.yaml --nproc-per-node gpu --nnodes 2 --rdzv-endpoint node1:29500   [dim](on both)[/]
    """
    check_torchrun_environment()  # a job script's partial torchrun environment: one line, before any work
    if not launched():
        quieten_torch(nnodes)  # before torch loads
        group = training_group(nproc_per_node, nnodes, rdzv_endpoint)
        if group.size > 1:  # this process starts the ones that train
            raise typer.Exit(launch_training(group, ctx.params, debug=ctx.find_root().params["debug"]))
    try:  # a signal here (torch loads for seconds) is answered like one during training
        from tformer_cli.runs import prepare_run

        cfg, run_dir = prepare_run(config, resume, list(overrides or []), output_dir, overwrite,
                                   main=launched_rank() == 0, device=device)  # the config checked before torch loads
        from tformer_cli import parallel
        from tformer_cli.devices import resolve_device
        from tformer_cli.render import TrainProgress, print_json
        from tformer_cli.train import train as run_training
    except KeyboardInterrupt as exc:
        _stopped_by_signal(getattr(exc, "signum", signal.SIGINT), None, launched_rank() == 0)
    workers = parallel.join(resolve_device(cfg.train.device), cfg.train.parallel)  # under torchrun: one of several
    progress = TrainProgress(quiet or json_output)
    try:
        result = run_training(cfg, run_dir, resume=resume is not None, callback=progress, workers=workers)
    except KeyboardInterrupt as exc:  # during setup, or a second signal while the first one's checkpoint is written
        progress.close()
        _stopped_by_signal(getattr(exc, "signum", signal.SIGINT), run_dir, workers.main)
    finally:
        progress.close()
        parallel.leave()
    if json_output and workers.main:
        print_json(result.summary())
    if result.signal is not None:
        _stopped_by_signal(result.signal, run_dir, workers.main)


def _stopped_by_signal(signum: int, run_dir: Path | None, main: bool) -> None:
    """One line on stderr, also under --quiet (where the checkpoint is, the command that resumes), and
    exit status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as shells report it."""
    if main:
        from tformer_cli.render import err_console
        from tformer_cli.runs import stop_message

        err_console.print(stop_message(signum, run_dir), highlight=False)
    raise typer.Exit(128 + signum)


app.command("eval")(eval_command)
app.command()(generate)


@app.command("inspect-attention")
def inspect_attention(
    run: RunArg,
    source: Annotated[str, typer.Argument(help="The source sentence.")],
    target: Annotated[Optional[str], typer.Option(help="Target text (default: the model's greedy output).")] = None,
    kind: Annotated[str, typer.Option(help="cross | encoder | decoder")] = "cross",
    layer: Annotated[str, typer.Option(help="Layer N (1-based), last, or all.")] = "all",
    head: Annotated[str, typer.Option(help="Head N (1-based), mean, or all.")] = "mean",
    values: Annotated[bool, typer.Option("--values", help="Print the weights in the cells.")] = False,
    save: Annotated[Optional[Path], typer.Option(help="Also draw the maps to an image (.png, .svg, .pdf).")] = None,
    device: DecodeDeviceOpt = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the weights and tokens as JSON.")] = False,
) -> None:
    """Show attention maps for one sentence: queries as rows, keys as columns, strongest key marked.

    [dim]Examples:[/]
      tformer inspect-attention runs/demo "twenty-one"
      tformer inspect-attention runs/demo "three hundred forty-two" --layer 2 --head all
      tformer inspect-attention runs/demo "twenty-one" --kind encoder --save attention.png
    """
    check_image_name("--save", save)
    check_text("SOURCE", source)
    check_text("--target", target)
    from rich.text import Text

    from tformer_cli.devices import resolve_device  # torch loads here (seconds): after the checks that need none
    from tformer_cli.introspect import capture_attention, maps_to_json, select_maps
    from tformer_cli.render import console, print_json, warn
    from tformer_cli.render_attention import print_maps, save_image, unlabelled_warning
    from tformer_cli.runtime import load_run

    loaded = load_run(run, resolve_device(device or "auto"))
    capture = capture_attention(loaded.model, loaded.vocab, source, target)
    maps = select_maps(capture, kind, layer, head)  # a mistake in --kind, --layer or --head: one line, no warning
    unknown = loaded.vocab.unknown_target_characters(target) if target and kind != "encoder" else ""
    if unknown:
        warn(f"--target: the run's target vocabulary has no token for {unknown!r}; the maps show <unk> there")
    if save is not None:
        unlabelled = unlabelled_warning(maps, save, save_image(maps, save))
        if unlabelled:
            warn(unlabelled)
    if json_output:
        print_json(maps_to_json(capture, kind, maps))
        return
    console.print(Text.assemble(("source", "bold"), f" {source}\n", ("target", "bold"), f" {capture.target_text}"))
    print_maps(maps, console, values)
    if save is not None:
        console.print(f"saved {save}", style="dim", highlight=False)


@app.command()
def average(
    run: RunArg,
    last: Annotated[Optional[int], typer.Option(help="Average the last N step checkpoints.")] = None,
    best: Annotated[Optional[int],
                    typer.Option(help="Average the N checkpoints with the best validation metric.")] = None,
    metric: Annotated[str, typer.Option(help="loss | bleu, for --best.")] = "loss",
    output: Annotated[Optional[Path], typer.Option(
        help="Folder (default RUN/checkpoints/average-last-N): inside RUN, RUN/checkpoints/average-NAME; outside "
             "RUN it also gets the run's config and tokenizer.")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Average checkpoint weights into a new checkpoint that eval and generate accept.

    [dim]Examples:[/]
      tformer average runs/multi30k --last 5
      tformer eval runs/multi30k/checkpoints/average-last-5 --beam-size 5
    """
    from tformer_cli.render import console, print_json
    from tformer_cli.run_folder import run_folder_of
    from tformer_cli.runtime import average_checkpoints, choose_checkpoints

    if metric not in ("loss", "bleu"):
        raise UsageError(f"--metric {metric}: expected loss or bleu")
    run = run_folder_of(run)
    chosen = choose_checkpoints(run, last, best, metric)
    name = f"average-last-{last}" if last is not None else f"average-best-{best}-{metric}"
    folder = average_checkpoints(chosen, output or run / "checkpoints" / name, run)
    if json_output:
        print_json({"checkpoint": str(folder), "averaged": [c.name for c in chosen]})
    else:
        console.print(f"averaged {', '.join(c.name for c in chosen)} -> {folder}", highlight=False)


@app.command()
def plot(
    run: RunArg,
    output: Annotated[Optional[Path], typer.Option(help="Image file (default RUN/curves.png).")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Draw learning curves (training and validation loss, validation BLEU) from RUN/metrics.jsonl.

    [dim]Examples:[/]
      tformer plot runs/demo --output curves.png
    """
    path = output or Path(run) / "curves.png"
    check_image_name("--output", path)
    from tformer_cli.render import console, print_json
    from tformer_cli.render_curves import plot_curves
    from tformer_cli.run_folder import read_metrics

    records = read_metrics(run)
    if not any(r.get("split") in ("train", "validation") for r in records):
        raise CheckpointError(f"{run}: metrics.jsonl holds no training or validation figures yet; train logs them "
                              "every train.log_every steps")
    plot_curves(records, path, title=str(run))
    if json_output:
        splits = [r.get("split") for r in records]
        print_json({"image": str(path), "train_points": splits.count("train"),
                    "validation_points": splits.count("validation")})
    else:
        console.print(f"saved {path}", highlight=False)


@app.command()
def export(
    run: RunArg,
    out: Annotated[Path, typer.Argument(help="A new folder for the exported model.")],
    to: Annotated[str, typer.Option(
        "--to", help="hf: a Hugging Face MarianMTModel folder; ctranslate2: a CTranslate2 model.")] = "hf",
    quantization: Annotated[Optional[str], typer.Option(
        help="ctranslate2: int8 | int8_float16 | int8_float32 | int8_bfloat16 | float16 | bfloat16 "
             "(default: float32).")] = None,
    push_to_hub: Annotated[Optional[str], typer.Option(
        metavar="REPO", help="hf: also upload the folder to this Hub repository (needs `hf auth login`).")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Export a trained model for use outside tformer: Hugging Face transformers, or CTranslate2.

    [dim]Examples:[/]
      tformer export runs/multi30k runs/multi30k-hf --to hf
      tformer export runs/multi30k runs/multi30k-hf --push-to-hub me/multi30k-de-en
      tformer export runs/multi30k runs/multi30k-ct2 --to ctranslate2 --quantization int8
    """
    if to not in ("hf", "ctranslate2"):
        raise UsageError(f"--to {to}: expected hf (a Hugging Face MarianMTModel folder) or ctranslate2")
    if quantization is not None and to != "ctranslate2":
        raise UsageError(f"--quantization {quantization}: only --to ctranslate2 quantizes")
    if push_to_hub and to != "hf":
        raise UsageError("--push-to-hub: only --to hf exports a Hub model")
    from tformer_cli.export import export_ctranslate2, export_hf, push  # torch loads here: after the checks
    from tformer_cli.render import console, print_json
    from tformer_cli.runtime import load_run

    loaded = load_run(run, "cpu", accel="off")
    if to == "hf":
        folder = export_hf(loaded.model, loaded.config, loaded.vocab, out)
    else:
        folder = export_ctranslate2(loaded.model, loaded.config, loaded.vocab, out, quantization)
    if push_to_hub:
        push(folder, push_to_hub)
    if json_output:
        print_json({"folder": str(folder), "format": to, "quantization": quantization, "pushed_to": push_to_hub})
    else:
        console.print(f"exported {loaded.weights} -> {folder}" + (f" (and {push_to_hub} on the Hub)" if push_to_hub
                                                                  else ""), highlight=False)


@app.command("count-params")
def count_params(
    config: Annotated[Optional[Path], typer.Argument(help="A YAML config; flags below override it.")] = None,
    d_model: Annotated[Optional[int], typer.Option("--d-model", help="Model width (default 512).")] = None,
    heads: Annotated[Optional[int], typer.Option("--num-heads", "--heads", help="Attention heads (default 8).")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Layers in each stack (default 6).")] = None,
    d_ff: Annotated[Optional[int], typer.Option("--d-ff", help="FFN width (default 4 x d_model).")] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab-size", "--vocab", help="Vocabulary size (default 37000).")] = None,
    share: Annotated[Optional[str], typer.Option(
        "--share-embeddings", "--share", help="Tied embeddings: all | decoder | none (default all).")] = None,
    encoder_layers: Annotated[Optional[int], typer.Option(rich_help_panel=ADVANCED)] = None,
    decoder_layers: Annotated[Optional[int], typer.Option(rich_help_panel=ADVANCED)] = None,
    norm: Annotated[Optional[str], typer.Option(help="post | pre", rich_help_panel=ADVANCED)] = None,
    positional: Annotated[Optional[str], typer.Option(
        help="sinusoidal | learned | rope | alibi", rich_help_panel=ADVANCED)] = None,
    max_len: Annotated[Optional[int], typer.Option(rich_help_panel=ADVANCED)] = None,
    overrides: SetOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Count parameters per component, by formula and from the built model (on the meta device).

    [dim]Examples:[/]
      tformer count-params --d-model 512
      tformer count-params configs/big.yaml --json
    """
    from tformer_cli.config import load_config
    from tformer_cli.params import summary
    from tformer_cli.render import param_table, print_json

    flags = [("--d-model", "model.d_model", d_model), ("--num-heads", "model.num_heads", heads),
             ("--d-ff", "model.d_ff", d_ff), ("--vocab-size", "data.vocab_size", vocab),
             ("--share-embeddings", "model.share_embeddings", share), ("--layers", "model.num_encoder_layers", layers),
             ("--layers", "model.num_decoder_layers", layers),  # the two below, where given, come after it
             ("--encoder-layers", "model.num_encoder_layers", encoder_layers),
             ("--decoder-layers", "model.num_decoder_layers", decoder_layers), ("--norm", "model.norm", norm),
             ("--positional", "model.positional", positional), ("--max-len", "model.max_len", max_len)]
    given = [(flag, key, value) for flag, key, value in flags if value is not None]
    sets = [f"{key}={value}" for _, key, value in given] + list(overrides or [])
    cfg = load_config(config, sets, flags={key: flag for flag, key, _ in given})
    vocab_size = cfg.data.vocab_size
    result = summary(cfg.model, vocab_size, vocab_size)
    print_json(result) if json_output else param_table(result)


def main() -> None:
    # SIGTERM (a scheduler's or a container's stop) is handled like Ctrl-C: one line and exit status 143
    signal.signal(signal.SIGTERM, _terminate)
    if sys.stdout is None:  # closed by the shell (>&-): what would go there is discarded, as print() does
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:  # (2>&-) messages too; the exit status still tells
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):  # text in is UTF-8 (cli_options.check_text), so is text out,
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower() not in ("utf-8", "utf8"):
            stream.reconfigure(encoding="utf-8")  # whatever the locale: ASCII's or a Windows code page
    try:
        app()
    except OSError as exc:  # a stream that cannot be written (output redirected to a full disk), even by --help
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "--debug" in sys.argv:
            raise
        from tformer_cli.render import error_lines

        error_lines(f"a write failed ({exc.strerror}): free space on the disk and run the command again")
        sys.exit(1)
    except SystemExit as done:
        parallel = sys.modules.get("tformer_cli.parallel")  # imported by `train` alone
        if parallel is not None and parallel.left_group and done.code in (0, None):
            parallel.end_process()
        raise


def _terminate(signum: int, frame) -> None:  # noqa: ANN001 - the signal module's signature
    raise Interrupted(signum)
