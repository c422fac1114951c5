"""The decoding commands, `eval` and `generate` (cli.py registers them on the app), and the flags
they share beyond those in cli_options.py: ensembles, repetition control, minimum-Bayes-risk."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from tformer_cli.cli_options import (
    ADVANCED, AccelOpt, AlphaOpt, BatchOpt, BeamOpt, DecodeDeviceOpt, JsonOpt, MaxTokensOpt, PrecisionOpt,
    RunArg, check_decoding_flags, check_engine, check_text, decoding_precision, load_for_decoding)
from tformer_cli.errors import UsageError
from tformer_cli.generate_input import check_prefix, input_batches

if TYPE_CHECKING:
    from tformer_cli.config import DataConfig
    from tformer_cli.tokenizer import Vocabulary

EnsembleOpt = Annotated[Optional[list[str]], typer.Option(
    "--ensemble", metavar="RUN[,RUN...]",
    help="Decode with these runs too (same vocabulary): their next-token probabilities are averaged.")]
MinLenOpt = Annotated[Optional[int], typer.Option(
    help="decode.min_len: no end of sentence before N tokens (the length limit makes room for them).")]
NoRepeatOpt = Annotated[Optional[int], typer.Option(
    "--no-repeat-ngram", help="decode.no_repeat_ngram: no N-gram occurs twice in an output.")]
MbrOpt = Annotated[int, typer.Option(
    "--mbr", help="Minimum-Bayes-risk: draw N candidates, keep the one that agrees most with the others.")]
MbrMetricOpt = Annotated[str, typer.Option(help="chrf | bleu: the agreement --mbr maximises.",
                                           rich_help_panel=ADVANCED)]
MbrCandidatesOpt = Annotated[str, typer.Option(
    help="sample | beam: --mbr's candidates are N samples, or the N best of a beam search.", rich_help_panel=ADVANCED)]
EpsilonOpt = Annotated[Optional[float], typer.Option(
    help="Sample only tokens of at least this probability (default: 0, off; 0.02 for --mbr's samples).")]
EngineOpt = Annotated[str, typer.Option(
    help="tformer | ctranslate2: the decoder that runs the model (ctranslate2: pip install 'tformer\\[ctranslate2]'; "
         "--precision int8 quantizes for it).", rich_help_panel=ADVANCED)]
SeedOpt = Annotated[Optional[int], typer.Option(help="Seed for reproducible samples.")]


def check_mbr(mbr: int, metric: str, candidates: str, nbest: int = 1) -> None:
    from tformer_cli.mbr import METRICS

    if mbr < 0 or mbr == 1:
        raise UsageError(f"--mbr {mbr}: must be >= 2, candidates for each to agree with (or 0: off)")
    if metric not in METRICS:
        raise UsageError(f"--mbr-metric {metric}: expected {' or '.join(METRICS)}")
    if candidates not in ("sample", "beam"):
        raise UsageError(f"--mbr-candidates {candidates}: expected sample or beam")
    if mbr and nbest > mbr:
        raise UsageError(f"--nbest {nbest} with --mbr {mbr}: MBR ranks {mbr} candidates; ask for at most that many")


def ensemble_runs(run: Path, ensemble: list[str] | None) -> list[Path]:
    """RUN, then the --ensemble runs (repeated or comma-separated)."""
    return [run] + [Path(part) for value in ensemble or [] for part in value.split(",") if part]


def eval_command(
    run: RunArg,
    split: Annotated[Optional[str], typer.Option(
        help="Split of the run's dataset (default: its data.test_split, e.g. test).")] = None,
    beam_size: BeamOpt = None,
    output: Annotated[Optional[Path], typer.Option(help="Write hypotheses here, one a line, in input order.")] = None,
    data_files: Annotated[Optional[list[str]], typer.Option(
        help="Evaluate these files instead: jsonl/csv/parquet (or a quoted pattern, 'shards/*.jsonl', for the files "
             "it matches, sorted), or a source and a reference text file, the option given once per file "
             "(--data-files src.txt --data-files ref.txt).")] = None,
    source_field: Annotated[Optional[str], typer.Option(help="Source field of --data-files.")] = None,
    target_field: Annotated[Optional[str], typer.Option(help="Target field of --data-files.")] = None,
    max_samples: Annotated[Optional[int], typer.Option(help="Only the first N pairs.")] = None,
    ensemble: EnsembleOpt = None,
    min_len: MinLenOpt = None,
    no_repeat_ngram: NoRepeatOpt = None,
    mbr: MbrOpt = 0,
    mbr_metric: MbrMetricOpt = "chrf",
    mbr_candidates: MbrCandidatesOpt = "sample",
    epsilon: EpsilonOpt = None,
    seed: SeedOpt = None,
    batch_size: BatchOpt = None,
    max_tokens: MaxTokensOpt = None,
    length_penalty: AlphaOpt = None,
    device: DecodeDeviceOpt = None,
    precision: PrecisionOpt = "auto",
    accel: AccelOpt = "auto",
    json_output: JsonOpt = False,
) -> None:
    """Score a trained model: loss, perplexity, BLEU, chrF, exact match and decoding speed.

    [dim]Examples:[/]
      tformer eval runs/demo
      tformer eval runs/demo --split validation --beam 1 --output hyps.txt --json
      tformer eval runs/demo --data-files my.jsonl --source-field en --target-field de
      tformer eval runs/a --ensemble runs/b,runs/c --beam 5
      tformer eval runs/demo --mbr 32 --seed 1
    """
    check_decoding_flags(beam_size=beam_size, batch_size=batch_size, max_tokens=max_tokens, max_samples=max_samples,
                         length_penalty=length_penalty, min_len=min_len, no_repeat_ngram=no_repeat_ngram,
                         epsilon=epsilon, seed=seed)
    check_mbr(mbr, mbr_metric, mbr_candidates)
    data_files = _check_data_files(data_files)
    from tformer_cli.decoding import DecodeOptions  # torch loads here (seconds): after the checks that need none
    from tformer_cli.devices import resolve_device
    from tformer_cli.evaluation import evaluate_run

    dev = resolve_device(device or "auto")
    precision = decoding_precision(precision, dev)
    runs = ensemble_runs(run, ensemble)
    loaded, models, amp = load_for_decoding(runs, dev, accel, precision)
    config = loaded.config
    split = split or config.data.test_split or "test"
    data = _eval_data(config.data, split, data_files, source_field, target_field, max_samples)
    if output:  # a wrong or unwritable path fails now, not after the evaluation (nor before the run loads)
        check_hypotheses_file(output, data)
    options = DecodeOptions.from_config(config.decode, beam_size=beam_size, length_penalty=length_penalty,
                                        min_len=min_len, no_repeat_ngram=no_repeat_ngram, mbr=mbr,
                                        mbr_metric=mbr_metric, mbr_candidates=mbr_candidates, epsilon=epsilon,
                                        seed=seed)
    check_min_len(options.min_len, models.max_len)
    with amp:
        result = evaluate_run(models, loaded.vocab, data, split, options, batch_size or config.decode.batch_size,
                              loss_tokens=config.train.max_tokens, device=dev,
                              batch_multiple=config.train.batch_multiple,
                              decode_tokens=max_tokens or config.decode.max_tokens)
    result.update(run=str(loaded.run_dir), weights=str(loaded.weights), beam_size=options.beam_size,
                  precision=precision)
    if len(runs) > 1:
        result["ensemble"] = [str(r) for r in runs]
    if mbr:
        result.update(mbr=mbr, mbr_metric=mbr_metric, mbr_candidates=mbr_candidates)
    _report_eval(result, output, json_output)


def _check_data_files(data_files: list[str] | None) -> list[str] | None:
    """``data_files`` with each glob pattern (a quoted ``'shards/*.jsonl'``) replaced by the files it
    matches, sorted, as training reads them; each checked to be a readable file."""
    from tformer_cli.data_paths import data_file_names, not_a_data_file

    files = [name for path in data_files or [] for name in data_file_names(path, "auto", option="--data-files")]
    for name in files:
        problem = not_a_data_file(name)
        if problem:
            raise UsageError(f"--data-files {name}: {problem}")
    return files or None


def _eval_data(data: DataConfig, split: str, data_files: list[str] | None, source_field: str | None,
               target_field: str | None, max_samples: int | None) -> DataConfig:
    """The run's data settings for ``split``, or ``data_files`` as that split, with eval's overrides; its
    paths made absolute as training makes them (a config edited by hand may name ``~/data``)."""
    from dataclasses import replace

    from tformer_cli.data_paths import absolute_paths

    data = absolute_paths(data)
    if data_files:
        data = replace(data, data_files={split: data_files}, format="auto")
    return replace(data, source=source_field or data.source, target=target_field or data.target,
                   max_samples=max_samples)


def _report_eval(result: dict, output: Path | None, json_output: bool) -> None:
    """Warn about empty references, write the hypotheses to ``output``, show the scores."""
    from tformer_cli.files import write_output
    from tformer_cli.render import eval_table, print_json, warn

    hypotheses = result.pop("hypotheses")
    if result["empty_references"]:
        warn(f"{result['empty_references']} of {result['sentences']} references are empty: their translations are "
             "scored against nothing and left out of the loss")
    if output:
        write_output(output, "".join(h + "\n" for h in hypotheses))
    print_json(result) if json_output else eval_table(result)


def generate(
    run: RunArg,
    texts: Annotated[Optional[list[str]], typer.Argument(help="Texts to translate; none: read stdin lines.")] = None,
    beam_size: BeamOpt = None,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of searching.")] = False,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature; 0 is greedy.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Sample from the smallest set with mass p.")] = None,
    epsilon: EpsilonOpt = None,
    seed: SeedOpt = None,
    nbest: Annotated[int, typer.Option(help="Hypotheses per input (tab-separated in plain output).")] = 1,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        help="At most this many output tokens (default: decode.max_len_a * source length + max_len_b); "
             "with --prefix, at least room for it and one token more.")] = None,
    min_len: MinLenOpt = None,
    no_repeat_ngram: NoRepeatOpt = None,
    prefix: Annotated[Optional[str], typer.Option(
        help="Every output starts with this text, and decoding goes on from it (a last word cut short is "
             "completed).")] = None,
    json_input: Annotated[bool, typer.Option(
        "--json-input", help='Read stdin as JSON lines, {"input": TEXT, "prefix": TEXT} (prefix optional).')] = False,
    align: Annotated[bool, typer.Option(
        "--align", help="Also print each output token's most attended source token (fairseq's A- lines).")] = False,
    align_layer: Annotated[Optional[int], typer.Option(
        help="Decoder layer (1-based) whose cross-attention --align reads (default: the last).",
        rich_help_panel=ADVANCED)] = None,
    ensemble: EnsembleOpt = None,
    mbr: MbrOpt = 0,
    mbr_metric: MbrMetricOpt = "chrf",
    mbr_candidates: MbrCandidatesOpt = "sample",
    batch_size: BatchOpt = None,
    max_tokens: MaxTokensOpt = None,
    length_penalty: AlphaOpt = None,
    device: DecodeDeviceOpt = None,
    precision: PrecisionOpt = "auto",
    accel: AccelOpt = "auto",
    engine: EngineOpt = "tformer",
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object a line.")] = False,
) -> None:
    """Translate texts given as arguments, or standard input line by line (one output line per input).

    [dim]Examples:[/]
      tformer generate runs/demo "twenty-one" "three hundred forty-two thousand fifteen"
      cat numbers.txt | tformer generate runs/demo --beam 4 > german.txt
      tformer generate runs/demo "seven" --sample --temperature 0.8 --top-p 0.9 --seed 1 --nbest 3 --json
      tformer generate runs/demo "twenty-one" --prefix "einund" --align
      tformer generate runs/demo "twenty-one" --engine ctranslate2 --precision int8
    """
    check_decoding_flags(beam_size=beam_size, nbest=nbest, batch_size=batch_size, max_tokens=max_tokens,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         epsilon=epsilon, length_penalty=length_penalty, min_len=min_len,
                         no_repeat_ngram=no_repeat_ngram, align_layer=align_layer, seed=seed)
    check_mbr(mbr, mbr_metric, mbr_candidates, nbest)
    _check_generate_flags(texts or [], prefix, sample, beam_size, mbr, mbr_candidates, json_input, min_len,
                          max_new_tokens)
    check_engine(engine, ensemble=bool(ensemble), mbr=mbr, align=align, epsilon=epsilon)
    from tformer_cli.batching import sentences_per_batch  # torch loads here (seconds): after the checks that need none
    from tformer_cli.decoding import DecodeOptions
    from tformer_cli.devices import resolve_device
    from tformer_cli.render import generation_lines

    dev = resolve_device(device or "auto")
    loaded, models, translate = _translator(engine, ensemble_runs(run, ensemble), dev, accel,
                                            decoding_precision(precision, dev))
    check_prefix(loaded.vocab, "--prefix", prefix)
    layers = min(len(model.decoder.layers) for model in models.models)
    if align_layer is not None and align_layer > layers:
        raise UsageError(f"--align-layer {align_layer}: the model has {layers} decoder layers")
    limits = {"max_len_a": 0.0, "max_len_b": max_new_tokens} if max_new_tokens is not None else {}
    options = DecodeOptions.from_config(
        loaded.config.decode, beam_size=1 if sample else beam_size, sample=sample, temperature=temperature,
        top_k=top_k, top_p=top_p, epsilon=epsilon, seed=seed, nbest=nbest, length_penalty=length_penalty,
        min_len=min_len, no_repeat_ngram=no_repeat_ngram, align_layer=(align_layer or layers) - 1 if align else None,
        mbr=mbr, mbr_metric=mbr_metric, mbr_candidates=mbr_candidates, **limits)
    check_min_len(options.min_len, models.max_len)
    batch_size, max_tokens = batch_size or loaded.config.decode.batch_size, max_tokens or loaded.config.decode.max_tokens
    chunks = input_batches(texts, prefix, json_input, loaded.vocab, sentences_per_batch(options, batch_size, max_tokens))
    warnings = _OutputWarnings(loaded.vocab, models.max_len, engine)
    for number, (result, forced) in enumerate(_translated(chunks, translate, options, batch_size, max_tokens)):
        warnings.check(result, forced)
        generation_lines(result, json_output, number, loaded.vocab if align else None)


def _translated(chunks, translate, options, batch_size: int, max_tokens: int | None):
    """(result, its prefix or "") for each input of ``chunks`` (lists of (text, prefix)), in order, a
    chunk translated at a time: a program on the other end of a pipe gets each chunk's answers at once."""
    for chunk in chunks:
        prefixes = [p or "" for _, p in chunk]
        yield from zip(translate([text for text, _ in chunk], options, batch_size,
                                 prefixes if any(prefixes) else None, max_tokens), prefixes)


class _OutputWarnings:
    """The warnings an output may call for: its input truncated, the model's positions run out inside
    its prefix, and (once a command) CTranslate2 ending it where its prefix ends."""

    def __init__(self, vocab: Vocabulary, max_len: int, engine: str) -> None:
        self.vocab, self.max_len = vocab, max_len
        self.watch_prefix_end = engine != "tformer"

    def check(self, result, prefix: str) -> None:
        from tformer_cli.render import warn

        if result.truncated:
            warn(f"input longer than the model's {self.max_len} positions was truncated: {result.source[:40]}…")
        if _prefix_cut(self.vocab, prefix, result, self.max_len):
            warn(f"the model's {self.max_len} positions ran out inside the prefix, so the output holds only its "
                 f"start: {prefix[:40]}…")
        if self.watch_prefix_end and _stopped_at_prefix(prefix, result):
            self.watch_prefix_end = False  # once a command
            warn(f"--engine ctranslate2 ended an output where its prefix ends ({prefix[-40:]!r}): it forces a "
                 "prefix as its own tokens and cannot complete a word cut short; --engine tformer completes it")


def _prefix_cut(vocab: Vocabulary, prefix: str, result, max_len: int) -> bool:
    """Whether an output filled the model's positions before it had written all of ``prefix``."""
    full = [h.tokens for _, h in result.outputs if len(h.tokens) >= max_len - 1]
    if not prefix or not full:  # the prefix is spelled only for an output that reached the limit
        return False
    spelled = vocab.spell_prefix(prefix)
    return any(not "".join(vocab.target_tokens(tokens)).startswith(spelled) for tokens in full)


def _stopped_at_prefix(prefix: str, result) -> bool:
    """Whether an output is ``prefix`` and no more, a prefix that does not end a word with a space: what
    CTranslate2 gives for a word cut short ("einund"), forced as the tokens it splits into alone."""
    return bool(prefix) and not prefix[-1].isspace() and any(text.strip() == prefix.strip()
                                                              for text, _ in result.outputs)


def _translator(engine: str, runs: list[Path], device, accel: str, precision: str):
    """(first run, the runs' models, translate(texts, options, batch_size, prefixes, max_tokens)) for
    ``--engine``: tformer's own decoding, or CTranslate2's over the first run converted."""
    from tformer_cli.decoding import translate

    if engine == "tformer":
        loaded, models, amp = load_for_decoding(runs, device, accel, precision)

        def translate_in_context(texts, options, batch_size, prefixes, max_tokens):
            with amp:
                return translate(models, loaded.vocab, texts, options, batch_size, device, prefixes, max_tokens)

        return loaded, models, translate_in_context
    from tformer_cli.ctranslate2_engine import CTranslate2Engine
    from tformer_cli.runtime import load_ensemble

    loaded, models = load_ensemble(runs[:1], "cpu", "off")  # CTranslate2 converts the plain fp32 model
    return loaded, models, CTranslate2Engine(loaded, device, precision).translate


def _check_generate_flags(texts: list[str], prefix: str | None, sample: bool, beam_size: int | None, mbr: int,
                          mbr_candidates: str, json_input: bool, min_len: int | None,
                          max_new_tokens: int | None) -> None:
    """The combinations of generate's flags that cannot work, and texts that are not UTF-8."""
    if min_len is not None and max_new_tokens is not None and min_len > max_new_tokens:
        raise UsageError(f"--min-len {min_len} is more than --max-new-tokens {max_new_tokens}: no output can be both; "
                         "lower --min-len or raise --max-new-tokens")
    if sample and beam_size is not None and beam_size > 1:
        raise UsageError(f"--beam-size {beam_size} with --sample: sampling draws each token at random, not by beam "
                         "search; drop --beam-size (--nbest N draws N samples)")
    if sample and mbr and mbr_candidates == "beam":
        raise UsageError("--sample with --mbr-candidates beam: the candidates come from a beam search; drop "
                         "--sample, or use --mbr-candidates sample")
    if json_input and texts:
        raise UsageError("--json-input reads standard input; drop the TEXTS arguments")
    if not texts and sys.stdin is None:  # closed by the shell (<&-)
        raise UsageError("standard input is closed: give the texts as arguments, or pipe lines in")
    check_text("--prefix", prefix)
    for text in texts:
        check_text("TEXTS", text)


def check_hypotheses_file(output: Path, data: DataConfig) -> None:
    """eval's ``--output`` may replace a file of its own, never a run's files or the data it reads; it
    is created now, so that an unwritable path fails before the evaluation."""
    from tformer_cli.data_paths import local_sources
    from tformer_cli.files import is_stream
    from tformer_cli.run_folder import is_run_file

    if output.is_dir():
        raise UsageError(f"--output {output}: is a folder; name a file for the hypotheses, e.g. {output / 'hyps.txt'}")
    if is_run_file(output):
        raise UsageError(f"--output {output}: is one of a run's own files, which the hypotheses would replace; "
                         "name another file, e.g. hyps.txt")
    where = output.resolve()
    for source in local_sources(data):
        if where == source or source in where.parents:
            raise UsageError(f"--output {output}: {'is' if where == source else 'lies in'} the data being evaluated "
                             f"({source}); write the hypotheses elsewhere, e.g. hyps.txt")
    if not is_stream(output):  # opened and closed, a pipe's reader would see its end
        output.parent.mkdir(parents=True, exist_ok=True)
        open(output, "a").close()


def check_min_len(min_len: int, max_len: int) -> None:
    """--min-len (or decode.min_len) within the positions of the model (the shortest of an ensemble's)."""
    if min_len > max_len - 1:
        raise UsageError(f"--min-len {min_len}: the model's {max_len} positions hold at most {max_len - 1} output "
                         "tokens; lower it")
