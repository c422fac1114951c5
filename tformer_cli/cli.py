"""The `tformer` command line: thin commands over the library, and the one error boundary.

Heavy imports (torch, datasets) happen inside command bodies so that `tformer --help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from tformer_cli import __version__
from tformer_cli.errors import TformerError

ADVANCED = "Advanced"


class _ErrorBoundary(TyperGroup):
    """Turns a TformerError into red lines on stderr and exit code 1; `--debug` shows the traceback."""

    def invoke(self, ctx):  # noqa: ANN001 - click's signature
        try:
            return super().invoke(ctx)
        except TformerError as exc:
            if ctx.params.get("debug"):
                raise
            from tformer_cli.render import error_lines

            error_lines(str(exc))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            from tformer_cli.render import error_lines

            error_lines("interrupted")
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_ErrorBoundary,
    help="Train, evaluate and inspect encoder-decoder Transformers (Vaswani et al. 2017).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options shared by several commands, declared once.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="SECTION.KEY=VALUE", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable).")]
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", help="auto | cpu | cuda (default: the config's train.device).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]


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


@app.command("count-params")
def count_params(
    config: Annotated[Optional[Path], typer.Argument(help="A YAML config; flags below override it.")] = None,
    d_model: Annotated[Optional[int], typer.Option("--d-model", help="Model width (default 512).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Attention heads (default 8).")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Layers in each stack (default 6).")] = None,
    d_ff: Annotated[Optional[int], typer.Option("--d-ff", help="FFN width (default 4 x d_model).")] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary size (default 37000).")] = None,
    share: Annotated[Optional[str], typer.Option(
        "--share", help="Tied embeddings: all | decoder | none (default all).")] = None,
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

    flags = {"model.d_model": d_model, "model.num_heads": heads, "model.d_ff": d_ff, "data.vocab_size": vocab,
             "model.share_embeddings": share, "model.num_encoder_layers": encoder_layers or layers,
             "model.num_decoder_layers": decoder_layers or layers, "model.norm": norm,
             "model.positional": positional, "model.max_len": max_len}
    sets = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(overrides or [])
    cfg = load_config(config, sets)
    vocab_size = cfg.data.vocab_size
    result = summary(cfg.model, vocab_size, vocab_size)
    print_json(result) if json_output else param_table(result)


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config (omit with --resume).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue the run in this folder.")] = None,
    overrides: SetOpt = None,
    device: DeviceOpt = None,
    output_dir: Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<config name>).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run folder.")] = False,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Train a model from a YAML config; checkpoints, metrics and the tokenizer go to a run folder.

    [dim]Examples:[/]
      tformer train configs/demo.yaml
      tformer train configs/small.yaml --set data.dataset=../shared/data/multi30k --device cuda
      tformer train --resume runs/demo --set train.max_steps=4000
    """
    from tformer_cli.render import TrainProgress, print_json
    from tformer_cli.train import prepare_run, train as run_training

    sets = list(overrides or []) + ([f"train.device={device}"] if device else [])
    cfg, run_dir = prepare_run(config, resume, sets, output_dir, overwrite)
    result = run_training(cfg, run_dir, resume=resume is not None, callback=TrainProgress(quiet or json_output))
    if json_output:
        print_json({"run_dir": str(run_dir), "stop_reason": result.stop_reason, "step": result.state.step,
                    "elapsed": result.state.elapsed, "last_eval": result.last_eval})
    if result.stop_reason == "interrupted":
        raise typer.Exit(130)


def main() -> None:
    app()
