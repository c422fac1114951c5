"""Command-line options shared by several `tformer` commands, declared once, and their checks.

The checks run before any model or data is loaded and raise one-line ``UsageError``s naming the flag.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from tformer_cli.config import check_accel_mode, check_device_name
from tformer_cli.errors import UsageError

ADVANCED = "Advanced"  # the help panel of rarely used options

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="SECTION.KEY=VALUE", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable).")]


def _device_name(name: str | None) -> str | None:
    """--device, spelled-checked as the command line is read (whether CUDA is there needs torch)."""
    if name is not None:
        check_device_name(name)
    return name


DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", help="auto | cpu | cuda (default: the config's train.device).", callback=_device_name)]
DecodeDeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", help="auto | cpu | cuda (default auto: a GPU where there is one).", callback=_device_name)]
NprocOpt = Annotated[Optional[str], typer.Option(
    "--nproc-per-node", metavar="N|gpu", help="Train with N processes on this machine, one a GPU (train.parallel: "
    "ddp or fsdp), as torchrun --standalone --nproc-per-node N does; gpu: one for each GPU it sees.")]
NnodesOpt = Annotated[Optional[int], typer.Option(
    "--nnodes", metavar="M", help="Train on M machines, this command started on each (with the same "
    "--nproc-per-node); they meet at --rdzv-endpoint, as torchrun --nnodes M --rdzv-backend c10d does.")]
RdzvOpt = Annotated[Optional[str], typer.Option(
    "--rdzv-endpoint", metavar="HOST:PORT", help="With --nnodes: where the machines meet, a free port on one of "
    "them (the same on each).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output (warnings and errors still).")]


def _existing_run(path: Path) -> Path:
    """RUN, checked as the command line is read: a mistyped folder is one line at once, not after the
    command has loaded torch (seconds)."""
    from tformer_cli.run_folder import existing

    return existing(path)


RunArg = Annotated[Path, typer.Argument(help="Run folder (or a checkpoint folder inside it).", callback=_existing_run)]

# decoding, for eval and generate
BeamOpt = Annotated[Optional[int], typer.Option(
    "--beam-size", "--beam", help="decode.beam_size: 1 is greedy (default: the run's config).")]
BatchOpt = Annotated[Optional[int], typer.Option(
    help="Sentences per batch (default: config; else 256 / beam, or as --max-tokens allows).",
    rich_help_panel=ADVANCED)]
MaxTokensOpt = Annotated[Optional[int], typer.Option(
    help="Decode batches of at most this many hypothesis tokens (sentences x beam x longest source), as "
         "fairseq's --max-tokens (default: config's decode.max_tokens).", rich_help_panel=ADVANCED)]
AlphaOpt = Annotated[Optional[float], typer.Option(help="GNMT length penalty alpha.", rich_help_panel=ADVANCED)]


def _accel_mode(mode: str) -> str:
    check_accel_mode(mode)
    return mode


def _precision(precision: str) -> str:
    check_precision(precision)
    return precision


AccelOpt = Annotated[str, typer.Option(
    help="auto | off: tformer's speed layer (faster CPU kernels; on GPUs, decoding as CUDA graphs with the model "
         "held in bf16 under --precision bf16), or the plain model.", rich_help_panel=ADVANCED, callback=_accel_mode)]
PrecisionOpt = Annotated[str, typer.Option(
    help="auto | fp32 | bf16 | fp16: autocast while decoding (bf16 is fast on GPUs and on CPUs with AVX-512 BF16 or "
         "AMX); int8: int8 weights on a CPU. auto: bf16 on a GPU with bf16 tensor cores (A100, H100), fp32 elsewhere.",
    rich_help_panel=ADVANCED, callback=_precision)]


def check_decoding_flags(**flags) -> None:
    """One-line errors for out-of-range decoding flags (None: not given). The flags that set a decode
    config key obey that key's range (config.DECODE_LIMITS), whose YAML null is a flag left out."""
    from tformer_cli.config import DECODE_LIMITS, SEED_RANGE

    at_least_one = (lambda v: v >= 1, ">= 1")
    limits = {**DECODE_LIMITS, "nbest": at_least_one, "max_new_tokens": at_least_one,
              "max_samples": at_least_one, "align_layer": at_least_one, "seed": SEED_RANGE}
    for name, value in flags.items():
        ok, expected = limits[name]
        if value is not None and not ok(value):
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be {expected.replace(' or null', '')}")
        if isinstance(value, int) and value >= 2 ** 63:  # past torch's integers
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be below 2^63")


ENGINES = ("tformer", "ctranslate2")  # generate --engine


def check_precision(precision: str) -> None:
    """--precision's value: auto, fp32, bf16, fp16 or int8 (what each can run on is checked on the device)."""
    if precision not in ("auto", "fp32", "bf16", "fp16", "int8"):
        raise UsageError(f"--precision {precision}: use auto, fp32, bf16 or fp16 (or int8, int8 weights on a CPU)")


def check_engine(engine: str, *, ensemble: bool, mbr: int, align: bool, epsilon: float | None) -> None:
    """One-line errors for an unknown engine, or flags CTranslate2 has no counterpart for."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: expected {' or '.join(ENGINES)}")
    if engine == "tformer":
        return
    for flag, given in (("--ensemble", ensemble), ("--mbr", mbr), ("--align", align), ("--epsilon", epsilon)):
        if given:
            raise UsageError(f"{flag} with --engine ctranslate2: {flag} is tformer's own; drop it, or decode "
                             "with --engine tformer")


def decoding_precision(setting: str, device) -> str:
    """--precision ``setting`` resolved on ``device`` (auto: bf16 on a recent GPU, as training); warns
    where auto decodes in fp32 on a GPU whose fp16 tensor cores would be faster."""
    from tformer_cli.devices import fp16_would_be_faster, resolve_precision
    from tformer_cli.render import warn

    faster = fp16_would_be_faster(setting, device)
    if faster:
        warn(f"--precision {faster}: use --precision fp16 (or fp32, which decodes as now without this warning)")
    return resolve_precision(setting, device)


def decoding_autocast(device, precision: str):
    """The --precision autocast context; warns when it would be slower than fp32 here."""
    from tformer_cli.devices import autocast, slow_precision
    from tformer_cli.render import warn

    if precision == "int8":  # int8 weights (runtime.load_run), no autocast
        if device.type != "cpu":
            raise UsageError("--precision int8: int8 weights are for CPUs; on a GPU use --precision bf16")
        return autocast(device, "fp32")
    check_precision(precision)
    amp = autocast(device, precision)
    slow = slow_precision(device, precision)
    if slow:
        warn(f"--precision {slow}; use --precision fp32")
    return amp


def held_in_bf16(device, precision: str, accel: str = "auto") -> bool:
    """Whether decoding holds the models in bf16 instead of running them under autocast: with
    ``--precision bf16`` on a GPU, as inference engines do, unless the speed layer is off (the plain
    path: fp32 weights under autocast). Autocast casts the activations entering each linear layer, a
    kernel each; held in bf16, greedy decoding of base as CUDA graphs is 1.28x faster on an H200, and
    Multi30k's test2016 BLEU stays within 0.1 of autocast's (benchmarks/README.md)."""
    return device.type == "cuda" and precision == "bf16" and accel != "off"


def load_for_decoding(runs: list[Path], device, accel: str, precision: str):
    """(first run, the runs' models as an ``Ensemble``, the context to decode in) for ``--precision``:
    the precision is checked before the models load, and with bf16 on a GPU they are held in bf16."""
    from tformer_cli.runtime import load_ensemble

    amp = decoding_autocast(device, precision)
    loaded, models = load_ensemble(runs, device, accel, int8=precision == "int8")
    return loaded, models, hold_for_decoding(models, device, precision, amp, accel)


def hold_for_decoding(models, device, precision: str, amp, accel: str = "auto"):
    """The context to decode in: none, with the models now held in bf16, where ``held_in_bf16``;
    elsewhere the autocast context ``amp`` from ``decoding_autocast``."""
    import torch

    if not held_in_bf16(device, precision, accel):
        return amp
    for model in models.models:
        model.to(torch.bfloat16)
    return nullcontext()


def check_image_name(option: str, path: Path | None) -> None:
    if path is not None and path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"{option} {path}: use a .png, .svg or .pdf file name")


def check_text(option: str, text: str | None) -> None:
    """A text given as an argument must be UTF-8: the shell passes other bytes through undecoded."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{option}: not UTF-8 text (character {exc.start + 1}); pass UTF-8, e.g. convert it with "
                         "iconv -t UTF-8") from None
