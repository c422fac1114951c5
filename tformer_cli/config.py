"""Typed configuration: one dataclass per YAML section, validated once at load time.

A config file has the sections ``model``, ``data``, ``train`` and ``decode``; any key may be
overridden from the command line as ``--set section.key=value`` (the value is parsed as YAML).
A file may start from another with ``extends: other.yaml`` (resolved relative to the file).
Every mistake in a file is reported together, one line each, with its key path. Reading the YAML,
``extends``, the overrides and the type checks are in ``config_parse``; the checks of values are here.

This module must not import torch: ``tformer --help`` and config checks stay instant.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import yaml

from tformer_cli.config_parse import apply_override, build_sections, merge, origin, read_yaml, shown_key
from tformer_cli.errors import ConfigError, UsageError, brief


@dataclass
class ModelConfig:
    """The network (paper §3). ``d_ff`` defaults to 4 * d_model."""

    d_model: int = 512  # width of every sublayer output and embedding; divisible by num_heads
    num_heads: int = 8  # attention heads
    num_encoder_layers: int = 6  # encoder depth
    num_decoder_layers: int = 6  # decoder depth
    d_ff: Optional[int] = None  # FFN inner width; null: 4 * d_model
    dropout: float = 0.1  # on sublayer outputs and on the embeddings plus positions
    attention_dropout: float = 0.0  # on the attention weights
    # Whole-word dropout (Marian's --dropout-src/--dropout-trg; Sennrich & Zhang 2019): while training, each
    # source and target input token's embedding is zeroed with this probability, before the positions are added.
    word_dropout: float = 0.0
    activation: Literal["relu", "gelu"] = "relu"  # the FFN's
    # Biases on the attention projections W^Q, W^K, W^V, W^O: the paper's are plain matrices (§3.2.2, as in
    # tensor2tensor); true adds them, as nn.MultiheadAttention and Marian do. The FFN keeps its b_1, b_2.
    attention_bias: bool = False
    norm: Literal["post", "pre"] = "post"  # post-LN (the paper) or pre-LN (with a final LayerNorm per stack)
    # sinusoidal (the paper), learned, rope (rotary, in self-attention) or alibi
    positional: Literal["sinusoidal", "learned", "rope", "alibi"] = "sinusoidal"
    max_len: int = 512  # positions
    # "all": source, target and output share one matrix (needs a joint vocabulary);
    # "decoder": target embedding and output projection only; "none": three matrices.
    share_embeddings: Literal["all", "decoder", "none"] = "all"
    layer_norm_eps: float = 1e-5  # epsilon of every LayerNorm

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model


@dataclass
class DataConfig:
    """Where the parallel text comes from and how it is tokenised."""

    dataset: Optional[str] = "bentrevett/multi30k"  # hub id or local dataset folder
    subset: Optional[str] = None  # the dataset's subset (configuration) where it has several, e.g. wmt14's de-en
    # a hub dataset's branch, tag or commit (null: its default branch); a run records the commit it read, so that a
    # resume, eval and the cache read that version, not one pushed since
    revision: Optional[str] = None
    data_files: Optional[dict[str, Any]] = None  # split -> file(s) or patterns (train-*.jsonl); overrides `dataset`
    # of data_files; tsv: source, tab, target a line (an `en<TAB>de` header optional); text: a [source, target]
    # pair of text files; auto: by extension, text for train.de + train.en
    format: Literal["auto", "json", "csv", "tsv", "parquet", "text"] = "auto"
    source: str = "de"  # field name; dotted for nested fields, e.g. translation.de
    target: str = "en"  # field name, as source
    train_split: str = "train"  # split names
    validation_split: Optional[str] = "validation"  # null: no validation
    test_split: Optional[str] = "test"  # eval's default split
    max_samples: Optional[int] = None  # use only the first N pairs of each split
    max_length: int = 256  # tokens per side, BOS/EOS included
    long_pairs: Literal["drop", "truncate"] = "drop"  # what to do with pairs longer than max_length
    vocab_size: int = 37000  # BPE vocabulary, special tokens included
    joint_vocab: bool = True  # one vocabulary for both sides (needed by share_embeddings all)
    min_frequency: int = 2  # of a BPE merge
    # learn BPE on at most this many training pairs, in blocks spread over the split (null: all), as Marian's
    # --sentencepiece-max-lines; encoding still covers every pair
    bpe_max_pairs: Optional[int] = 2_000_000
    lowercase: bool = False  # lowercase the text before BPE
    # BPE-dropout (Provilkov et al. 2020): while training, each merge is skipped with this probability and the
    # training split is segmented afresh every epoch; validation, test and decoding keep the plain segmentation.
    # Each checkpoint keeps its epoch's segmentation, so that a resume goes on exactly (tokenizers' draws take no
    # seed: train.seed does not fix them).
    bpe_dropout: float = 0.0


@dataclass
class TrainConfig:
    """Optimisation, schedule, stopping, evaluation and checkpointing."""

    output_dir: Optional[str] = None  # default runs/<config name>
    seed: int = 0  # seeds initialisation, dropout and data order; in [0, 2^32)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when available
    # fp32, or bf16 / fp16 autocast (bf16 on CPUs with AVX-512 BF16 or AMX); auto: bf16 on a GPU with
    # bf16 tensor cores (A100, H100 and later), fp32 elsewhere (a V100 or T4, with fp16 tensor cores alone,
    # warns that fp16 would be faster)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # torch.compile the encoder and decoder; auto: on a GPU that Triton compiles for, compute capability 7.0
    # or later (H200, base: 1.22x the tokens/s after ~98 s of compiling), not on a CPU (slower there)
    compile: Literal["auto", True, False] = "auto"
    accel: Literal["auto", "off"] = "auto"  # the speed layer (tformer_cli/accel): auto where it pays, off: plain
    parallel: Literal["ddp", "fsdp"] = "ddp"  # several processes: replicate the model (ddp), or shard it (fsdp)
    tensorboard: bool = False  # also log the figures to RUN/tensorboard/ (pip install 'tformer[tensorboard]')
    max_tokens: int = 4096  # padded tokens (source or target, the larger) per batch
    # sentences per batch rounded down to a multiple of this where that many fit (fairseq's
    # --required-batch-size-multiple): fewer product shapes, so less memory for CPU kernels
    batch_multiple: int = 8
    grad_accum: int = 1  # batches per optimizer step (each process's)
    # pack each batch's sentence pairs end to end into rows of about this many tokens, attention kept
    # within each sentence (as T5 packs its examples): less padding, and on GPUs far fewer attention
    # tiles of mostly padding; null: each sentence padded to its batch's longest. Sinusoidal or learned
    # positions only.
    pack_length: Optional[int] = None
    # padded tokens an optimizer step takes over all processes and accumulated batches (the paper's
    # ~25,000): each step is cut once and shared out, so one GPU or eight take the same steps, in as
    # many batches a process as keep each to about max_tokens (grad_accum follows); null: each process
    # takes grad_accum batches of max_tokens a step
    step_tokens: Optional[int] = None
    optimizer: Literal["adam", "adamw"] = "adam"  # adam, or adamw (decoupled weight decay)
    # With schedule "noam", lr is the scale factor of d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
    # otherwise it is the peak learning rate.
    lr: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # Adam's
    eps: float = 1e-9  # Adam's
    weight_decay: float = 0.0  # on matrices only, not biases and LayerNorms
    # noam (lr is a scale), or inverse_sqrt, cosine, constant (lr is the peak) after a linear warmup
    schedule: Literal["noam", "inverse_sqrt", "cosine", "constant"] = "noam"
    warmup_steps: int = 4000  # linear warmup
    # the rate cosine ends at, in [0, train.lr]: at max_steps or epochs, or with max_time at the step the
    # pace so far reaches
    min_lr: float = 0.0
    label_smoothing: float = 0.1  # epsilon of §5.4
    rdrop: float = 0.0  # R-Drop weight alpha: each batch runs twice, their output KL divergence is penalised
    clip_grad_norm: Optional[float] = 1.0  # null: no clipping
    max_steps: Optional[int] = 100000  # stop at whichever of max_steps, epochs and max_time comes first
    epochs: Optional[int] = None  # passes over the training split
    max_time: Optional[float] = None  # seconds of training before stopping
    log_every: int = 50  # steps between logged training figures
    eval_every: int = 1000  # steps between validations
    eval_bleu: bool = True  # greedy BLEU and chrF on the validation split too
    eval_max_sentences: int = 500  # validation sentences decoded for BLEU
    best_metric: Literal["loss", "bleu"] = "loss"  # which validation figure picks model.safetensors
    patience: Optional[int] = None  # evaluations without improvement before stopping
    save_every: Optional[int] = None  # steps between checkpoints (default: eval_every)
    keep_last: int = 3  # step checkpoints kept
    ema_decay: float = 0.0  # > 0: keep an exponential moving average of the weights (checkpoints/ema)


@dataclass
class DecodeConfig:
    """Defaults for `generate` and `eval`; every one can be given as a flag too."""

    beam_size: int = 4  # 1: greedy
    length_penalty: float = 0.6  # GNMT alpha, in [0, 10]; 0: none
    max_len_a: float = 1.2  # output length limit: a * source_length + b (at least min_len; within model.max_len)
    max_len_b: int = 10  # see max_len_a
    min_len: int = 0  # no end of sentence before this many output tokens (the length limit makes room for them)
    no_repeat_ngram: int = 0  # n > 0: no n-gram of output tokens occurs twice (fairseq's no_repeat_ngram_size)
    batch_size: Optional[int] = None  # sentences per batch; null: 256 hypotheses (64 sentences at beam 4), or max_tokens
    max_tokens: Optional[int] = None  # at most this many hypothesis tokens a batch (sentences x beam x longest source)
    temperature: float = 1.0  # sampling (generate --sample)
    top_k: int = 0  # sampling: only the k most likely tokens; 0: all
    top_p: float = 1.0  # sampling: the smallest set of tokens with this mass
    epsilon: Optional[float] = None  # sampling: only tokens of at least this probability; null: 0 (off), 0.02 for MBR


# train.seed's and --seed's: a seed is combined with epochs, steps and ranks into torch's 64-bit seeds
SEED_RANGE: tuple[Callable[[int], bool], str] = (lambda v: 0 <= v < 2 ** 32, "in [0, 2^32)")

# The range of each decode setting, for the config check and for the same flags of `eval` and `generate`.
DECODE_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "beam_size": (lambda v: v >= 1, ">= 1"),
    # >= 0 for beam search's early stop; past 10 no output length would matter, and ((5 + length) / 6)^alpha overflows
    "length_penalty": (lambda v: 0 <= v <= 10, "in [0, 10] (0: no length normalisation; 0.6 to 1 usual)"),
    "batch_size": (lambda v: v is None or v >= 1, ">= 1 or null"),
    "max_tokens": (lambda v: v is None or v >= 1, ">= 1 or null"),
    "min_len": (lambda v: v >= 0, ">= 0"),
    "no_repeat_ngram": (lambda v: v >= 0, ">= 0 (0: off)"),
    "temperature": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "top_k": (lambda v: v >= 0, ">= 0 (0: no limit)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "epsilon": (lambda v: v is None or 0 <= v < 1, "in [0, 1) or null"),
    "max_len_a": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    "max_len_b": (lambda v: v >= 0, ">= 0"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    name: str = "config"


MAX_VOCAB = 2**24  # far past any BPE vocabulary in use; the tokenizers library aborts the process near 10^9

_TRAIN_TYPES = typing.get_type_hints(TrainConfig)
DEVICES = typing.get_args(_TRAIN_TYPES["device"])  # ("auto", "cpu", "cuda"): train.device and --device
ACCEL_MODES = typing.get_args(_TRAIN_TYPES["accel"])  # ("auto", "off"): train.accel and --accel


def check_device_name(name: str, option: str = "--device") -> None:
    """A one-line UsageError naming ``option`` for a device that is not auto, cpu or cuda; whether CUDA
    is there is for ``devices.resolve_device`` to say, once torch has loaded."""
    if re.fullmatch(r"cuda:\d+", name):  # torch's spelling of one GPU of several
        raise UsageError(f"{option} {name}: give cuda, and pick the GPU with CUDA_VISIBLE_DEVICES={name[5:]}")
    if name not in DEVICES:
        raise UsageError(f"{option} {name}: expected auto, cpu or cuda")


def check_accel_mode(mode: str, option: str = "--accel") -> None:
    """A one-line UsageError for a speed-layer mode other than auto or off."""
    if mode not in ACCEL_MODES:
        raise UsageError(f"{option} {mode}: use auto (the speed layer where it pays) or off (the plain model)")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "decode": DecodeConfig}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


# What runs saved before a key existed were trained with, where it differs from the key's default: a run
# folder's config.yaml that lacks the key gets this value, not the default.
SAVED_RUN_DEFAULTS: dict[str, dict[str, Any]] = {"model": {"attention_bias": True}, "train": {"batch_multiple": 1}}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                saved_run: bool = False, flags: dict[str, str] | None = None) -> Config:
    """Read a YAML config (following ``extends``), apply ``section.key=value`` overrides, validate.
    ``saved_run``: the file is a run folder's config.yaml (keys it lacks take ``SAVED_RUN_DEFAULTS``).
    ``flags``: the keys that a command's own options set, with the option's name (``model.d_model`` ->
    ``--d-model``); a mistake in one is named by its option, one in another override by its ``--set``.

    Raises:
        ConfigError: listing every mistake, one line each, prefixed by the file name.
    """
    raw: dict[str, Any] = {}
    source = "command line"
    if path is not None:
        path = Path(path)
        raw = read_yaml(path, SECTIONS)
        if saved_run:
            raw = merge(copy.deepcopy(SAVED_RUN_DEFAULTS), raw, SECTIONS)
        source = str(path)
    errors: list[str] = []
    overridden = {apply_override(raw, item, errors) for item in overrides or []} - {None} - set(flags or {})
    sections, wrong = build_sections(raw, SECTIONS, errors)
    config = Config(**sections, name=Path(path).stem if path is not None else "config")
    # Values are checked beside wrong types too, so that every mistake is reported at once; a check that
    # names a key of the wrong type (now at its default, d_model 512 say) would mislead, and is left out
    named = [re.compile(rf"\b{re.escape(key.rpartition('.')[2])}\b") for key in wrong]
    errors += [e for e in validate(config) if not any(key.search(e) for key in named)]
    if errors:
        lines = (origin(e, overridden, source, flags or {}) for e in errors)
        raise ConfigError("\n".join(dict.fromkeys(lines)))  # --layers 0 is two mistakes, said once
    return config


def to_dict(config: Config) -> dict[str, Any]:
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Validation of values (types are already right)
# ---------------------------------------------------------------------------------------------


def validate(config: Config) -> list[str]:
    """Return one message per invalid value, each naming its key path and the fix."""
    errors: list[str] = []

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            errors.append(f"{key}: {message}")

    _validate_model(config.model, need)
    _validate_data(config.data, config.model, need)
    _validate_train(config.train, config.data, config.model, need)
    for key, (ok, expected) in DECODE_LIMITS.items():
        value = getattr(config.decode, key)
        need(ok(value), f"decode.{key}", f"must be {expected}, got {value}")
    need(config.decode.min_len < config.model.max_len, "decode.min_len",
         f"{config.decode.min_len}: the model's {config.model.max_len} positions (model.max_len) hold at most "
         f"{config.model.max_len - 1} output tokens; lower it")
    return errors


Need = Callable[[bool, str, str], None]  # need(ok, key, message) records the message unless ok


def _heads_near(heads: int, d_model: int, tries: int = 64) -> int | None:
    """The head count nearest ``heads`` that divides ``d_model`` (the larger of two as near), if one is
    within ``tries`` of it."""
    heads = min(heads, d_model)
    near = (h for step in range(tries) for h in (heads + step, heads - step) if 0 < h <= d_model)
    return next((h for h in near if d_model % h == 0), None)


def _validate_model(m: ModelConfig, need: Need) -> None:
    for key in ("d_model", "num_heads", "d_ff", "max_len"):  # d_ff, 4 * d_model by default, follows d_model's error
        need(getattr(m, key) > 0 or (key == "d_ff" and m.d_model <= 0), f"model.{key}",
             f"must be > 0, got {getattr(m, key)}")
    for key in ("num_encoder_layers", "num_decoder_layers"):
        need(getattr(m, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(m, key)}")
    if m.d_model > 0 and m.num_heads > 0:
        if m.d_model % m.num_heads:
            below = m.d_model - m.d_model % m.num_heads  # the widths nearest d_model that the heads divide
            widths = f"{below} or {below + m.num_heads}" if below else f"{m.num_heads}"
            heads = _heads_near(m.num_heads, m.d_model)
            need(False, "model.num_heads", f"d_model {m.d_model} is not divisible by num_heads {m.num_heads} (each "
                 f"head takes d_model / num_heads channels); use d_model {widths}"
                 + (f", or num_heads {heads}" if heads else ""))
        if m.positional == "rope" and m.d_model % m.num_heads == 0:
            need((m.d_model // m.num_heads) % 2 == 0, "model.positional",
                 f"rope rotates pairs of a head's channels and needs an even head size, got d_model / num_heads "
                 f"= {m.d_model // m.num_heads}; choose num_heads so that d_model / num_heads is even, or another "
                 "positional")
    for key in ("dropout", "attention_dropout", "word_dropout"):
        need(0.0 <= getattr(m, key) < 1.0, f"model.{key}", f"must be in [0, 1), got {getattr(m, key)}")
    need(m.layer_norm_eps > 0, "model.layer_norm_eps", f"must be > 0, got {m.layer_norm_eps}")


def _validate_data(d: DataConfig, m: ModelConfig, need: Need) -> None:
    need(bool(d.dataset) or bool(d.data_files), "data.dataset",
         "set data.dataset (hub id or folder) or data.data_files (split -> files)")
    need(not (d.subset and d.data_files), "data.subset",
         "selects a subset of data.dataset, not of data.data_files; remove one of them")
    need(not (d.revision and d.data_files), "data.revision",
         "selects a version of a hub data.dataset, not of data.data_files; remove one of them")
    for split, files in (d.data_files or {}).items():
        need(isinstance(split, str) and bool(split), f"data.data_files.{shown_key(split)}",
             "a split is named in text (train, validation, test); quote it")
        paths = files if isinstance(files, list) else [files]
        need(bool(paths) and all(isinstance(f, str) and f for f in paths), f"data.data_files.{shown_key(split)}",
             f"expected a file name or a list of them, got {brief(files)}")
    need(d.max_samples is None or d.max_samples > 0, "data.max_samples", f"must be > 0, got {d.max_samples}")
    need(d.max_length >= 3, "data.max_length", f"must be >= 3 (BOS, a token, EOS), got {d.max_length}")
    need(d.max_length <= m.max_len, "data.max_length",
         f"{d.max_length} exceeds model.max_len {m.max_len}; lower it or raise model.max_len")
    need(0.0 <= d.bpe_dropout < 1.0, "data.bpe_dropout", f"must be in [0, 1), got {d.bpe_dropout}")
    need(16 <= d.vocab_size <= MAX_VOCAB, "data.vocab_size", f"must be in [16, {MAX_VOCAB:,}], got {d.vocab_size}")
    need(d.min_frequency >= 0, "data.min_frequency", f"must be >= 0, got {d.min_frequency}")
    need(d.bpe_max_pairs is None or d.bpe_max_pairs > 0, "data.bpe_max_pairs",
         f"must be > 0 (or null: every pair), got {d.bpe_max_pairs}")
    need(d.joint_vocab or m.share_embeddings != "all", "model.share_embeddings",
         "'all' needs data.joint_vocab: true; use 'decoder' with separate vocabularies")


def _validate_train(t: TrainConfig, d: DataConfig, m: ModelConfig, need: Need) -> None:
    need(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    need(SEED_RANGE[0](t.seed), "train.seed", f"must be {SEED_RANGE[1]}, got {t.seed}")
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas",
         f"must be two numbers in [0, 1), got {t.betas}")
    need(t.eps > 0, "train.eps", f"must be > 0, got {t.eps}")
    need(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    need(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    need(t.min_lr >= 0, "train.min_lr", f"must be >= 0, got {t.min_lr}")  # below, cosine's steps would ascend the loss
    need(t.schedule != "cosine" or t.min_lr <= t.lr, "train.min_lr",
         f"{t.min_lr} is above train.lr {t.lr}, the peak that the cosine schedule decays from; lower it")
    need(t.schedule != "noam" or t.warmup_steps > 0, "train.warmup_steps", "the noam schedule needs warmup_steps > 0")
    need(0.0 <= t.label_smoothing < 1.0, "train.label_smoothing", f"must be in [0, 1), got {t.label_smoothing}")
    need(0.0 <= t.ema_decay < 1.0, "train.ema_decay", f"must be in [0, 1) (0 turns it off), got {t.ema_decay}")
    need(t.rdrop >= 0, "train.rdrop", f"must be >= 0 (0 turns R-Drop off), got {t.rdrop}")
    need(not t.rdrop or m.dropout > 0 or m.attention_dropout > 0 or m.word_dropout > 0, "train.rdrop",
         "needs dropout (with model.dropout, attention_dropout and word_dropout 0 both passes are the same); "
         "set model.dropout > 0 or train.rdrop=0")
    need(t.clip_grad_norm is None or t.clip_grad_norm > 0, "train.clip_grad_norm",
         f"must be > 0 or null, got {t.clip_grad_norm}")
    need(t.max_tokens >= d.max_length, "train.max_tokens",
         f"{t.max_tokens} is smaller than one sequence (data.max_length {d.max_length}); raise it")
    need(t.step_tokens is None or t.step_tokens >= d.max_length, "train.step_tokens",
         f"{t.step_tokens} is smaller than one sequence (data.max_length {d.max_length}); raise it, or null")
    need(t.step_tokens is None or t.grad_accum == 1, "train.grad_accum",
         "follows from train.step_tokens and max_tokens; leave it at 1, or set train.step_tokens=null")
    for key in ("grad_accum", "batch_multiple", "log_every", "eval_every", "keep_last", "eval_max_sentences"):
        need(getattr(t, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    need(t.pack_length is None or t.pack_length > 0, "train.pack_length", f"must be > 0 or null, got {t.pack_length}")
    need(t.pack_length is None or m.positional in ("sinusoidal", "learned"), "train.pack_length",
         f"needs model.positional sinusoidal or learned (got {m.positional}, which places tokens by their place "
         "in the row); or set it to null")
    for key in ("max_steps", "epochs", "max_time", "patience", "save_every"):
        value = getattr(t, key)
        need(value is None or value > 0, f"train.{key}", f"must be > 0 or null, got {value}")
    need(t.max_steps is not None or t.epochs is not None or t.max_time is not None, "train.max_steps",
         "set at least one of train.max_steps, train.epochs or train.max_time so training can stop")
