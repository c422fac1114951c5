"""The bad-input corpus: every file and stream tformer reads, crossed with the ways it can be wrong.

Each case runs one command through the CLI and must give exactly one line on stderr that names the
problem and the fix (matched by the case's pattern), a non-zero exit, no traceback, and no file on disk
changed. Cache entries, which are rebuilt rather than refused, are in test_reliability.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tformer_cli.cli import app

NUMBERS = Path(__file__).resolve().parents[1] / "data" / "numbers"
BINARY = bytes(range(256)) * 4
LATIN1 = "model:\n  d_model: 32  # Größe\n".encode("latin-1")


@dataclass
class Case:
    name: str
    argv: list[str]  # "{tmp}" is the case's folder, "{run}" a copy of a trained run in it
    expect: str  # a substring of the one error line: what was wrong and how to fix it
    files: dict[str, bytes | str] = field(default_factory=dict)  # written in the case's folder first
    run_files: dict[str, bytes | str | None] = field(default_factory=dict)  # changes to the run copy; None deletes
    stdin: bytes | None = None


def _config(**sections) -> str:
    config = {
        "model": {"d_model": 32, "num_heads": 4, "num_encoder_layers": 1, "num_decoder_layers": 1, "d_ff": 64,
                  "max_len": 64},
        "data": {"dataset": str(NUMBERS), "source": "en", "target": "de", "max_length": 48, "vocab_size": 200,
                 "min_frequency": 1, "max_samples": 100},
        "train": {"max_tokens": 600, "max_steps": 2, "device": "cpu"},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return yaml.safe_dump(config)


GOOD = _config()
TRAIN = ["train", "{tmp}/c.yaml", "--output-dir", "{tmp}/out", "--quiet"]


def _train_with(text: str | bytes, name: str, expect: str, *extra: str) -> Case:
    return Case(name, TRAIN + list(extra), expect, files={"c.yaml": text})


def _config_cases() -> list[Case]:
    """The CONFIG given to train: each way a YAML file can be wrong, and each key out of range."""
    cases = [
        Case("config/missing", TRAIN, "config file not found"),
        Case("config/folder", ["train", "{tmp}", "--output-dir", "{tmp}/out"], "is a folder; pass an existing YAML file"),
        Case("config/device", ["train", "/dev/null", "--output-dir", "{tmp}/out"], "is not a regular file"),
        _train_with("", "config/empty", "the file is empty"),
        _train_with("# only a comment\n", "config/only-comment", "the file is empty"),
        _train_with(GOOD[: GOOD.index("vocab_size") + 10] + "[1, 2", "config/truncated", "invalid YAML"),
        _train_with(BINARY, "config/binary", "not UTF-8 text"),
        _train_with(LATIN1, "config/non-utf8", "not UTF-8 text"),
        _train_with("- model\n- data\n", "config/list", "expected a mapping of sections"),
        _train_with("42\n", "config/scalar", "expected a mapping of sections"),
        _train_with("model: [1, 2]\n", "config/section-list", "model: expected a mapping of keys"),
        _train_with("model: 7\n", "config/section-scalar", "model: expected a mapping of keys"),
        _train_with("modle: {d_model: 8}\n", "config/unknown-section", "did you mean 'model'"),
        _train_with(_config(model={"d_modle": 8}), "config/unknown-key", "did you mean 'd_model'"),
        _train_with("model: {d_model: 32\n", "config/unclosed", "invalid YAML"),
        _train_with("model:\n\td_model: 32\n", "config/tab", "invalid YAML"),
        _train_with("a: &x\n  b: *y\n", "config/bad-alias", "invalid YAML"),
        _train_with("!!python/object/apply:os.system ['true']\n", "config/python-tag", "invalid YAML"),
        _train_with(GOOD + "train:\n  lr: 0.01\n", "config/section-twice", "'train' is given twice; keep one"),
        _train_with("model:\n  d_model: 32\n  dropout: 0.1\n  d_model: 64\n", "config/key-twice",
                    "invalid YAML at line 4: 'd_model' is given twice"),
        _train_with(_config(data={"data_files": "train.jsonl", "dataset": None}), "config/data-files-str",
                    "data.data_files: expected a mapping"),
        _train_with(_config(data={"data_files": {"train": 3}}), "config/data-files-number",
                    "data.data_files.train: expected a file name"),
        _train_with(_config(data={"data_files": {"train": []}}), "config/data-files-empty",
                    "data.data_files.train: expected a file name"),
        _train_with(_config(train={"betas": 0.9}), "config/betas-scalar", "train.betas: expected a list"),
        _train_with(_config(train={"betas": [0.9]}), "config/betas-short", "train.betas: must be two numbers"),
    ]
    wrong_types = [("model", "d_model", "abc", "expected an integer"), ("model", "d_model", 3.5, "expected an integer"),
                   ("model", "d_model", True, "expected an integer"), ("model", "dropout", "high", "expected a number"),
                   ("model", "norm", "middle", "must be one of 'post', 'pre'"),
                   ("model", "positional", "sine", "must be one of"), ("model", "activation", 1, "must be one of"),
                   ("data", "source", 5, "expected a string"), ("data", "joint_vocab", "yes please", "expected true or false"),
                   ("train", "lr", [1], "expected a number"), ("train", "max_steps", "ten", "expected an integer"),
                   ("train", "optimizer", "sgdd", "must be one of 'adam', 'adamw'"), ("train", "precision", "fp8", "must be one of"),
                   ("train", "device", "gpu", "must be one of"), ("decode", "beam_size", "four", "expected an integer"),
                   ("train", "compile", "yes", "must be one of 'auto', true, false"), ("train", "compile", 1, "must be one of"),
                   ("train", "lr", ".nan", "expected a finite number"),
                   ("train", "lr", ".inf", "expected a finite number"),
                   ("model", "dropout", "-.inf", "expected a finite number")]
    for section, key, value, expect in wrong_types:
        text = _config(**{section: {key: value}})
        if isinstance(value, str) and value.startswith((".", "-.")):
            text = text.replace(f"'{value}'", value)  # a YAML float, not a string
        cases.append(_train_with(text, f"config/type/{section}.{key}={value}", f"{section}.{key}: {expect}"))
    out_of_range = [("model", "d_model", -1, "must be > 0"), ("model", "num_heads", 0, "must be > 0"),
                    ("model", "num_heads", 5, "d_model 32 is not divisible by num_heads 5"), ("model", "d_ff", 0, "must be > 0"),
                    ("model", "num_encoder_layers", 0, "must be >= 1"), ("model", "dropout", 1.0, "must be in [0, 1)"),
                    ("model", "attention_dropout", -0.1, "must be in [0, 1)"), 
                    ("model", "layer_norm_eps", 0, "must be > 0"), ("data", "vocab_size", 3, "must be in [16, 16,777,216], got 3"),
                    ("data", "vocab_size", 10**9, "must be in [16, 16,777,216], got 1000000000"),
                    ("data", "max_length", 2, "must be >= 3"), ("data", "max_length", 100, "100 exceeds model.max_len 64"),
                    ("data", "max_samples", 0, "must be > 0"), ("data", "bpe_dropout", 1.5, "must be in [0, 1)"),
                    ("data", "bpe_max_pairs", 0, "must be > 0 (or null: every pair)"),
                    ("train", "lr", -1, "must be > 0"), ("train", "lr", 0, "must be > 0"),
                    ("train", "max_tokens", 10, "10 is smaller than one sequence"), ("train", "grad_accum", 0, "must be >= 1"),
                    ("train", "eps", -5, "must be > 0"), ("train", "label_smoothing", 1.0, "must be in [0, 1)"),
                    ("train", "clip_grad_norm", 0, "must be > 0 or null"), ("train", "max_steps", -3, "must be > 0"),
                    ("train", "keep_last", 0, "must be >= 1"), ("train", "ema_decay", 1.0, "must be in [0, 1)"),
                    ("train", "weight_decay", -0.1, "must be >= 0"), ("train", "betas", [0.9, 1.0], "must be two numbers in [0, 1)"),
                    ("decode", "beam_size", 0, "must be >= 1"), ("decode", "max_len_a", -1, "must be >= 0 and finite, got -1"),
                    ("decode", "max_len_b", -5, "must be >= 0, got -5")]
    for section, key, value, expect in out_of_range:
        cases.append(_train_with(_config(**{section: {key: value}}), f"config/range/{section}.{key}={value}",
                                 f"{section}.{key}: {expect}"))
    cases.append(_train_with(_config(train={"max_steps": None}), "config/never-stops",
                             "train.max_steps: set at least one of"))
    cases.append(_train_with(_config(train={"pack_length": 0}), "config/range/train.pack_length=0",
                             "train.pack_length: must be > 0 or null, got 0"))
    cases.append(_train_with(_config(model={"positional": "rope"}, train={"pack_length": 128}),
                             "config/pack-length-with-rope", "train.pack_length: needs model.positional sinusoidal or "
                             "learned (got rope"))
    return cases


def _extends_cases() -> list[Case]:
    child = "extends: base.yaml\ntrain: {max_steps: 1}\n"
    cases = [Case("extends/missing", TRAIN, "base.yaml: config file not found", files={"c.yaml": child})]
    for name, base, expect in [("empty", "", "the file is empty"), ("binary", BINARY, "not UTF-8 text"),
                               ("non-utf8", LATIN1, "not UTF-8 text"), ("truncated", "model: {d_model: 32\n", "invalid YAML"),
                               ("list", "[1, 2]\n", "expected a mapping of sections"),
                               ("wrong-type", _config(model={"d_model": "x"}), "model.d_model: expected an integer"),
                               ("out-of-range", _config(model={"dropout": 2}), "model.dropout: must be in [0, 1)"),
                               ("cycle", "extends: c.yaml\n", "'extends' forms a cycle")]:
        cases.append(Case(f"extends/{name}", TRAIN, expect, files={"c.yaml": child, "base.yaml": base}))
    cases.append(Case("extends/not-a-string", TRAIN, "extends: expected a file name",
                      files={"c.yaml": "extends: [a.yaml]\n"}))
    return cases


def _set_cases() -> list[Case]:
    sets = [("train.lr", "expected section.key=value"), ("=3", "expected section.key=value"),
            ("lr=3", "expected section.key=value"), ("a.b.c.d=1", "expected section.key=value"),
            ("train..lr=1", "expected section.key=value"), ("trian.lr=1", "did you mean 'train'"),
            ("train.lrr=1", "did you mean 'lr'"), ("train.lr=abc", "train.lr: expected a number"),
            ("train.lr=-1", "train.lr: must be > 0"), ("model.d_model=[1", "model.d_model: expected an integer"),
            ("model.num_heads=7", "not divisible"), ("data.vocab_size=1e9x", "expected an integer"),
            ("train.max_steps=0", "train.max_steps: must be > 0"), ("decode.beam_size=-2", "must be >= 1"),
            ("decode.min_len=64", "decode.min_len: 64: the model's 64 positions (model.max_len) hold at most 63"),
            ("train.lr=.nan", "expected a finite number"), ("model=1", "expected section.key=value")]
    return [Case(f"set/{item}", TRAIN + ["--set", item], expect, files={"c.yaml": GOOD}) for item, expect in sets]


def _data_cases() -> list[Case]:
    """Training data named by data.data_files, and eval --data-files, in every format."""
    bad = {
        "jsonl": [("missing", None, "data file not found"), ("empty", "", "the file is empty"),
                  ("truncated", '{"en": "one", "de": ', "could not read"), ("binary", BINARY, "not UTF-8 text"),
                  ("non-utf8", '{"en": "one", "de": "eins'.encode() + b"\xff\"}\n", "not UTF-8 text"),
                  ("wrong-type", '{"en": 1, "de": 2}\n', "holds int64, not text"),
                  ("mixed-types", '{"en": "one", "de": "eins"}\n{"en": "two", "de": 2}\n',
                   "field 'de' is not all text ({tmp}/d.jsonl: split '"),
                  ("wrong-structure", "[1, 2, 3]\n", "not in the dataset"),
                  ("wrong-fields", '{"fr": "un", "es": "uno"}\n', "field 'en' not in the dataset")],
        "csv": [("empty", "", "the file is empty"), ("non-utf8", b"en,de\none,eins\xff\n", "not UTF-8 text"),
                ("wrong-fields", "a,b\n1,2\n", "field 'en' not in the dataset"),
                ("wrong-type", "en,de\n1,2\n", "holds int64, not text")],
        "tsv": [("no-tab", "one eins\ntwo zwei\n", "the first line has no tab; a .tsv file holds the source, a tab")],
        "parquet": [("empty", "", "the file is empty"), ("binary", BINARY, "could not read"),
                    ("truncated", b"PAR1\x00\x00", "could not read")],
    }
    cases = []
    for fmt, variants in bad.items():
        for name, content, expect in variants:
            files = {} if content is None else {f"d.{fmt}": content}
            data = {"dataset": None, "data_files": {"train": "{tmp}/d." + fmt}, "validation_split": None}
            cases.append(Case(f"data/train/{fmt}/{name}", TRAIN, expect,
                              files={**files, "c.yaml": _config(data=data)}))
            cases.append(Case(f"data/eval/{fmt}/{name}", ["eval", "{run}", "--data-files", "{tmp}/d." + fmt],
                              "--data-files {tmp}/d." + fmt + ": no such file" if content is None else expect,
                              files=files))
    texts = [("length-mismatch", "one\ntwo\n", "eins\n", "differ in length"),
             ("non-utf8", b"one\xff\n", "eins\n", "not UTF-8 text"),
             ("binary", BINARY, "eins\n", "not UTF-8 text"),
             ("references-empty", "one\ntwo\n", "\n\n", "every reference (de) of split 'test' is empty")]
    for name, source, target, expect in texts:
        files = {"s.txt": source, "t.txt": target}
        cases.append(Case(f"data/eval/text/{name}", ["eval", "{run}", "--data-files", "{tmp}/s.txt",
                                                     "--data-files", "{tmp}/t.txt"], expect, files=files))
    cases += [
        Case("data/eval/text/one-file", ["eval", "{run}", "--data-files", "{tmp}/s.txt"], "needs two parallel files",
             files={"s.txt": "one\n"}),
        Case("data/eval/a-folder", ["eval", "{run}", "--data-files", "{tmp}"], "{tmp}: is a folder; name its files"),
        Case("data/train/a-folder", TRAIN, "{tmp}: is a folder; name its files", files={"c.yaml": _config(data={
            "dataset": None, "data_files": {"train": "{tmp}"}, "validation_split": None})}),
        Case("data/eval/a-url", ["eval", "{run}", "--data-files", "https://example.com/test.jsonl"],
             "--data-files https://example.com/test.jsonl: is a URL, and data files are read from local disk"),
        Case("data/train/a-url", TRAIN, "hf://datasets/org/wmt/train.parquet: is a URL", files={"c.yaml": _config(
            data={"dataset": None, "data_files": {"train": "hf://datasets/org/wmt/train.parquet"},
                  "validation_split": None})}),
        Case("data/eval/unknown-format", ["eval", "{run}", "--data-files", "{tmp}/d.xml"], "set data.format",
             files={"d.xml": "<a/>"}),
        Case("data/eval/wrong-field-flag", ["eval", "{run}", "--data-files", str(NUMBERS / "test.jsonl"),
                                            "--source-field", "fr"], "field 'fr' not in the dataset"),
        Case("data/train/revision-of-a-folder", TRAIN, "data.revision: selects a version of a hub dataset, and",
             files={"c.yaml": _config(data={"revision": "v2"})}),
        Case("data/train/revision-of-data-files", TRAIN, "data.revision: selects a version of a hub data.dataset, "
             "not of data.data_files", files={"c.yaml": _config(data={"revision": "v2", "dataset": None,
                                                                      "data_files": {"train": "t.jsonl"}})}),
        Case("data/train/dataset-folder-missing", TRAIN, "no such folder",
             files={"c.yaml": _config(data={"dataset": "./nowhere"})}),
        Case("data/train/dataset-folder-without-data", TRAIN, "a dataset folder holds a file per split",
             files={"c.yaml": _config(data={"dataset": "{tmp}"})}),
        Case("data/train/dataset-folder-with-brackets", TRAIN, "holds one of * ? [ which datasets reads as a pattern; "
             "rename the folder, or name its files in data.data_files", files={
                 "c.yaml": _config(data={"dataset": "{tmp}/d[1]"}), "d[1]/train.jsonl": '{"en": "one", "de": "eins"}\n'}),
        Case("data/train/dataset-folder-two-formats", TRAIN, "holds split 'train' in 2 formats (train.jsonl, "
             "train.tsv), of which only one would be read; keep one format there, or choose the files with "
             "data.data_files", files={"c.yaml": _config(data={"dataset": "{tmp}/d"}),
                                       "d/train.jsonl": '{"en": "one", "de": "eins"}\n', "d/train.tsv": "two\tzwei\n"}),
        Case("data/train/split-missing", TRAIN, "has no split 'dev'",
             files={"c.yaml": _config(data={"validation_split": "dev"})}),
        Case("data/eval/split-missing", ["eval", "{run}", "--split", "dev"], "has no split 'dev'"),
        Case("data/train/every-target-null", TRAIN, "no train pairs left: all 2 have an empty (or null) en or de; "
             "check data.source", files={"d.jsonl": '{"en": "one", "de": null}\n{"en": "two", "de": " "}\n',
                                         "c.yaml": _config(data={"dataset": None, "data_files": {"train": "{tmp}/d.jsonl"},
                                                                 "validation_split": None})}),
        Case("data/train/every-pair-too-long", TRAIN, "no train pairs left: 2 are longer than data.max_length 3 "
             "tokens and 1 empty; raise", files={"d.jsonl": '{"en": "one two three four five", "de": "eins"}\n' * 2
                                                         + '{"en": "", "de": "x"}\n', "c.yaml": _config(data={
                 "dataset": None, "data_files": {"train": "{tmp}/d.jsonl"}, "validation_split": None, "max_length": 3})}),
        Case("data/train/every-validation-pair-too-long", TRAIN, "no validation pairs left: 2 are longer than",
             files={"d/train.jsonl": '{"en": "one", "de": "eins"}\n',
                    "d/validation.jsonl": '{"en": "one two three four", "de": "eins zwei drei vier"}\n' * 2,
                    "c.yaml": _config(data={"dataset": "{tmp}/d", "max_length": 3})}),
        Case("data/train/no-validation-file", TRAIN, "(or data.validation_split: null to train without one)",
             files={"d/train.jsonl": (NUMBERS / "train.jsonl").read_text(), "c.yaml": _config(data={"dataset": "{tmp}/d"})}),
    ]
    return cases


def _run_file_cases() -> list[Case]:
    """Every file of a run folder, read by eval, generate, inspect-attention, average, plot and --resume."""
    readers = {
        "config.yaml": [["eval", "{run}", "--max-samples", "2"], ["generate", "{run}", "seven"],
                        ["train", "--resume", "{run}", "--quiet"]],
        "tokenizer.json": [["generate", "{run}", "seven"], ["inspect-attention", "{run}", "seven"]],
        "model.safetensors": [["generate", "{run}", "seven"], ["eval", "{run}", "--max-samples", "2"]],
        "checkpoints/LAST/trainer.pt": [["train", "--resume", "{run}", "--quiet"]],
        "checkpoints/LAST/model.safetensors": [["train", "--resume", "{run}", "--quiet"],
                                                        ["average", "{run}", "--last", "2"]],
        "metrics.jsonl": [["plot", "{run}", "--output", "{tmp}/c.png"], ["average", "{run}", "--best", "1"]],
    }
    problems = {
        "config.yaml": [("empty", "", "the file is empty"), ("binary", BINARY, "not UTF-8 text"),
                        ("non-utf8", LATIN1, "not UTF-8 text"), ("truncated", "model:\n  d_model: [", "invalid YAML"),
                        ("wrong-shape", "[1]\n", "expected a mapping of sections"),
                        ("out-of-range", "model: {dropout: 2}\n", "model.dropout: must be in [0, 1)"),
                        ("missing", None, "not a run folder (no config.yaml)")],
        "tokenizer.json": [("empty", "", "unreadable tokenizer"), ("binary", BINARY, "unreadable tokenizer"),
                           ("truncated", '{"version": "1.0", "model": {', "unreadable tokenizer"),
                           ("wrong-shape", "[1, 2]", "unreadable tokenizer"),
                           ("non-utf8", b'{"version": "\xff"}', "unreadable tokenizer"),
                           ("missing", None, "no tokenizer.json")],
        "model.safetensors": [("empty", "", "unreadable weights"), ("binary", BINARY, "unreadable weights"),
                              ("truncated", "TRUNCATE", "unreadable weights"),
                              ("wrong-shape", "SMALL", "weights do not fit the model")],
        "checkpoints/LAST/trainer.pt": [("empty", "", "unreadable trainer state"),
                                                 ("binary", BINARY, "unreadable trainer state"),
                                                 ("truncated", "TRUNCATE", "unreadable trainer state"),
                                                 ("pickle", "PICKLE", "unreadable trainer state (not a file tformer wrote"),
                                                 ("wrong-structure", "TENSOR", "unreadable trainer state"),
                                                 ("wrong-contents", "STATE", "trainer state does not fit this run")],
        "checkpoints/LAST/model.safetensors": [("empty", "", "unreadable weights"),
                                                        ("binary", BINARY, "unreadable weights"),
                                                        ("wrong-shape", "SMALL", "weights do not fit|differ in names or shapes")],
        "metrics.jsonl": [("binary", BINARY, "not UTF-8 text"), ("non-utf8", b'{"a": "\xff"}\n', "not UTF-8 text"),
                          ("wrong-structure", "[1, 2]\n{}\n", "line 1: not a JSON object"),
                          ("empty", "", "holds no training or validation figures|no validation loss recorded"),
                          ("missing", None, "no metrics.jsonl")],
    }
    cases = []
    for path, variants in problems.items():
        for name, content, expect in variants:
            for argv in readers[path]:
                cases.append(Case(f"run/{path}/{name}/{argv[0]}", argv, expect, run_files={path: content}))
    return cases


def _argument_cases() -> list[Case]:
    gen, ins = ["generate", "{run}"], ["inspect-attention", "{run}"]
    flags = [
        (gen + ["seven", "--beam", "0"], "--beam-size 0: must be >= 1"), (gen + ["seven", "--nbest", "0"], "--nbest 0"),
        (gen + ["seven", "--batch-size", "0"], "--batch-size 0"), (gen + ["seven", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (gen + ["seven", "--top-p", "1.5"], "--top-p 1.5"), (gen + ["seven", "--top-k", "-1"], "--top-k -1"),
        (gen + ["seven", "--temperature", "-1"], "--temperature -1"), (gen + ["seven", "--mbr", "1"], "--mbr 1: must be >= 2"),
        (gen + ["seven", "--prefix", "€"], "no token for '€'"),
        (gen + ["seven", "--sample", "--beam", "3"], "drop --beam-size"),
        (gen + ["seven", "--min-len", "5", "--max-new-tokens", "3"], "--min-len 5 is more than --max-new-tokens 3"),
        (gen + ["seven", "--min-len", "64"], "--min-len 64: the model's 64 positions hold at most 63 output tokens"),
        (["eval", "{run}", "--min-len", "64"], "--min-len 64: the model's 64 positions hold at most 63 output tokens"),
        (gen + ["seven", "--device", "gpu"], "--device gpu: expected auto, cpu or cuda"),
        (gen + ["seven", "--device", "cuda:1"], "--device cuda:1: give cuda, and pick the GPU with CUDA_VISIBLE_DEVICES=1"),
        (gen + ["seven", "--precision", "int4"], "use auto, fp32, bf16 or fp16"),
        (gen + [b"seven \xff".decode("utf-8", "surrogateescape")], "TEXTS: not UTF-8 text"),
        (["generate", "{tmp}/nowhere", "seven"], "no such run folder"),
        (["generate", "{tmp}", "seven"], "neither a run folder nor a checkpoint"),
        (["generate", "{run}/checkpoints", "seven"], "a folder of checkpoints, not one; name one of them (step-"),
        (ins + [b"\xffseven".decode("utf-8", "surrogateescape")], "SOURCE: not UTF-8 text"),
        (ins + ["seven", "--target", b"\xff".decode("utf-8", "surrogateescape")], "--target: not UTF-8 text"),
        (ins + ["seven", "--layer", "9"], "--layer 9"), (ins + ["seven", "--head", "0"], "--head 0"),
        (ins + ["seven", "--kind", "sideways"], "--kind sideways"), (ins + ["", "--layer", "1"], "source text is empty"),
        (ins + ["seven " * 80], "more than the model's 64 positions; inspect a shorter sentence"),
        (ins + ["seven", "--target", "sieben " * 80], "--target needs 81 positions, more than the model's 64; give"),
        (ins + ["seven", "--save", "{tmp}/a.jpeg"], "use a .png, .svg or .pdf"),
        (["eval", "{run}", "--beam-size", "-1"], "--beam-size -1"), (["eval", "{run}", "--max-samples", "0"], "--max-samples 0"),
        (["eval", "{run}", "--length-penalty", "-1"], "--length-penalty -1"),
        (["eval", "{run}", "--output", "{run}/model.safetensors/x.txt"],
         "model.safetensors: a file, where a folder is needed; move it or pick another path"),
        (["average", "{run}", "--last", "1", "--output", "{tmp}/c.yaml"], "c.yaml: a file, where a folder is needed"),
        (["plot", "{run}", "--output", "{tmp}/c.yaml/curves.png"], "c.yaml: a file, where a folder is needed"),
        (["eval", "{run}", "--output", "{run}"], "is a folder; name a file for the hypotheses"),
        (["average", "{run}", "--last", "0"], "--last 0: must be >= 1"),
        (["average", "{run}", "--last", "9"], "step checkpoints; ask for at most"),
        (["average", "{run}"], "give exactly one of --last N or --best N"),
        (["average", "{run}", "--best", "1", "--metric", "rouge"], "--metric rouge"),
        (["plot", "{run}", "--output", "{tmp}/c.jpeg"], "use a .png, .svg or .pdf"),
        (["count-params", "--d-model", "0"], "--d-model: must be > 0"),
        (["count-params", "--heads", "7"], "not divisible"), (["count-params", "--share", "some"], "must be one of"),
        (["count-params", "--norm", "mid"], "--norm: must be one of 'post', 'pre'"),
        (["count-params", "{tmp}/nowhere.yaml"], "config file not found"),
        (["train"], "give either a CONFIG"), (["train", "--resume", "{tmp}/nowhere"], "not a run folder"),
        (TRAIN + ["--device", "tpu"], "--device tpu: expected auto, cpu or cuda"),
        (["train", "--resume", "{run}", "--set", "model.d_model=64"], "a resumed run keeps its model.d_model"),
        (["train", "--resume", "{run}", "--set", "data.vocab_size=300"], "keeps its data.vocab_size"),
        (["train", "{tmp}/c.yaml", "--resume", "{run}"], "give either a CONFIG"),
        (TRAIN[:2] + ["--output-dir", "{run}"], "already holds a run; continue it with --resume"),
        (TRAIN[:2] + ["--output-dir", "{tmp}/c.yaml"], "is a file; pick a folder"),
        # what click itself cannot parse: one line too, naming the help that shows the usage
        (["trian"], "No such command 'trian'. Did you mean 'train'? (tformer -h shows the usage)"),
        (["--bogus"], "No such option: --bogus (tformer -h shows the usage)"),
        (["eval"], "Missing argument 'run' (tformer eval -h shows the usage)"),
        (gen + ["seven", "--beam"], "Option '--beam' requires an argument (tformer generate -h shows the usage)"),
        (["count-params", "--layers", "two"], "Invalid value for '--layers': Input should be a valid integer, unable to parse string as an integer (tformer count-params -h"),
        (["eval", "{run}", "--length-penalty", "high"], "Invalid value for '--length-penalty'"),
        (["average", "{run}", "--last", "2", "--unknown"], "No such option: --unknown (tformer average -h shows the usage)"),
    ]
    cases = [Case(f"args/{i:02d}/{argv[0]}", argv, expect, files={"c.yaml": GOOD}) for i, (argv, expect) in
             enumerate(flags)]
    cases += [Case("stdin/non-utf8", gen, "standard input, line 2: not UTF-8 text", stdin=b"seven\nacht\xff\n"),
              Case("stdin/binary", gen, "standard input, line 2: not UTF-8 text", stdin=BINARY),
              Case("stdin/latin1", gen, "standard input, line 1: not UTF-8 text", stdin="dreißig\n".encode("latin-1"))]
    return cases


CASES = _config_cases() + _extends_cases() + _set_cases() + _data_cases() + _run_file_cases() + _argument_cases()


def test_the_corpus_is_large_and_its_names_unique():
    assert len(CASES) >= 150 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_line_a_nonzero_exit_and_nothing_changed(case, tmp_path, trained_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    needs_run = any("{run}" in arg for arg in case.argv) or case.run_files
    run = tmp_path / "run"
    if needs_run:
        shutil.copytree(trained_run, run)
        last = sorted((run / "checkpoints").glob("step-*"))[-1].name  # other tests may have resumed the run
        for path, content in case.run_files.items():
            _damage(run / path.replace("LAST", last), content)
    fill = {"{tmp}": str(tmp_path), "{run}": str(run)}
    for name, content in case.files.items():
        for key, value in fill.items():
            content = content.replace(key, value) if isinstance(content, str) else content
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(content.encode() if isinstance(content, str) else content)
    argv = [_fill(arg, fill) for arg in case.argv]
    before = _snapshot(tmp_path)
    with warnings.catch_warnings(record=True) as caught:  # a warning would print lines of its own
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, argv, input=case.stdin)
    shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
    assert not shown, [str(w.message) for w in shown]
    lines = result.stderr.strip().splitlines()
    assert result.exit_code not in (0, None) and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and any(e in lines[0] for e in _fill(case.expect, fill).split("|")), lines[0]
    assert _snapshot(tmp_path) == before


def _fill(text: str, fill: dict[str, str]) -> str:
    for key, value in fill.items():
        text = text.replace(key, value)
    return text


def _damage(path: Path, content: bytes | str | None) -> None:
    """Replace a run file: None deletes it; TRUNCATE cuts it; SMALL, PICKLE, TENSOR and STATE are files
    of the right kind with the wrong contents."""
    import pickle

    import torch
    from safetensors.torch import save_file

    if content is None:
        path.unlink()
    elif content == "TRUNCATE":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "SMALL":
        save_file({"encoder.embed.weight": torch.zeros(3, 3)}, str(path))
    elif content == "PICKLE":
        path.write_bytes(pickle.dumps(print))  # a function by reference: weights_only refuses it
    elif content == "TENSOR":
        torch.save(torch.zeros(3), path)
    elif content == "STATE":
        torch.save({"optimizer": {"state": {}}, "state": {"stepp": 1}, "rng": {}}, path)
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_pipe_as_a_data_file_is_one_line(tmp_path, trained_run):
    """datasets reads a file by its name, more than once: ``--data-files <(zcat test.jsonl.gz)`` cannot work."""
    pipe = tmp_path / "fifo.jsonl"
    os.mkfifo(pipe)  # never opened: the check looks at what it is
    result = CliRunner().invoke(app, ["eval", str(trained_run), "--data-files", str(pipe)])
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: --data-files {pipe}: is not a regular file (a pipe, say); write the data to a file first (.gz files "
        "are read as they are)")


def test_generate_with_standard_input_closed_is_one_line(trained_run):
    """``tformer generate RUN <&-``: no stream at all where the lines would come from."""
    result = subprocess.run([sys.executable, "-m", "tformer_cli", "generate", str(trained_run)], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, preexec_fn=lambda: os.close(0))
    assert result.returncode == 1 and result.stderr.strip() == (
        "error: standard input is closed: give the texts as arguments, or pipe lines in")


def test_output_closed_is_discarded_as_print_discards_it(trained_run):
    """``tformer generate RUN TEXT >&-``: no traceback; what would have been printed is dropped."""
    result = subprocess.run([sys.executable, "-m", "tformer_cli", "generate", str(trained_run), "seven"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1))
    assert result.returncode == 0 and result.stderr == ""


# Run in a fresh interpreter: each mistake through the CLI, then whether torch has been imported
_BEFORE_TORCH = """
import json, sys
from tformer_cli.cli import app

answers = []
for argv in json.loads(sys.argv[1]):
    try:
        app(argv, prog_name="tformer")
    except SystemExit as exc:
        answers.append([exc.code, "torch" in sys.modules])
print(json.dumps(answers))
"""


def test_mistakes_that_need_nothing_loaded_are_found_before_torch_loads(tmp_path):
    """torch takes seconds to import (3.4 s on 2 cores of an AMD EPYC, Zen 3): a mistyped key, value,
    path or flag is one line at once, not after it."""
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  dataset: {NUMBERS}\n  source: en\n  target: de\n")
    (tmp_path / "run").mkdir()  # there, but no run: what is wrong with it needs the run loaded
    mistakes = [
        ["train", str(config), "--set", "train.lr=-1"],
        ["train", str(config), "--set", "model.num_head=3"],
        ["train", str(tmp_path / "missing.yaml")],
        ["train", str(config), "--set", f"data.dataset={tmp_path / 'missing'}"],
        ["train", str(config), "--set", f"data.data_files.train={tmp_path / 'missing.jsonl'}"],
        ["train", str(config), "--nproc-per-node", "2", "--set", "train.label_smoothing=2"],
        ["train", "--resume", str(tmp_path / "missing")],
        ["train", str(config), "--device", "gpu"],
        ["eval", str(tmp_path / "missing")],
        ["eval", str(tmp_path / "run"), "--mbr", "1"],
        ["eval", str(tmp_path / "run"), "--accel", "fast"],
        ["eval", str(tmp_path / "run"), "--precision", "bf8"],
        ["generate", str(tmp_path / "missing"), "seven"],
        ["generate", str(tmp_path / "run"), "seven", "--beam-size", "0"],
        ["generate", str(tmp_path / "run"), "seven", "--sample", "--beam-size", "2"],
        ["generate", str(tmp_path / "run"), "seven", "--engine", "marian"],
        ["generate", str(tmp_path / "run"), "seven", "--engine", "ctranslate2", "--mbr", "4"],
        ["generate", str(tmp_path / "run"), "seven", "--device", "cuda:1"],
        ["inspect-attention", str(tmp_path / "missing"), "seven"],
        ["inspect-attention", str(tmp_path / "run"), "seven", "--device", "tpu"],
        ["inspect-attention", str(tmp_path / "run"), "seven", "--save", str(tmp_path / "maps.jpg")],
        ["average", str(tmp_path / "missing"), "--last", "2"],
        ["plot", str(tmp_path / "missing")],
        ["plot", str(tmp_path / "run")],  # no metrics.jsonl
        ["plot", str(tmp_path / "run"), "--output", str(tmp_path / "curves.jpg")],
        ["export", str(tmp_path / "missing"), str(tmp_path / "out")],
        ["export", str(tmp_path / "run"), str(tmp_path / "out"), "--to", "onnx"],
    ]
    result = subprocess.run([sys.executable, "-c", _BEFORE_TORCH, json.dumps(mistakes)], capture_output=True,
                            text=True, env={**os.environ, "TFORMER_CACHE": str(tmp_path / "cache")})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 0 and len(errors) == len(mistakes), result.stderr[-3000:]
    assert json.loads(result.stdout) == [[1, False]] * len(mistakes), list(zip(errors, result.stdout))
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_plot_draws_a_runs_curves_without_loading_torch(tmp_path, trained_run):
    image = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, "-c", _BEFORE_TORCH, json.dumps([["plot", str(trained_run), "--output",
                                                                             str(image)]])],
                            capture_output=True, text=True)
    assert json.loads(result.stdout.splitlines()[-1]) == [[0, False]], result.stderr[-3000:]
    assert image.read_bytes().startswith(b"\x89PNG")
