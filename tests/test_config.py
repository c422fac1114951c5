from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tformer_cli.cli import app
from tformer_cli.config import load_config, to_yaml
from tformer_cli.errors import ConfigError
from tformer_cli.model import build_model

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds(path):
    import torch

    cfg = load_config(path)
    assert path.read_text().startswith("# tformer ")  # each config opens with the command that runs it
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data.vocab_size)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_base_config_is_the_papers_base_model():
    cfg = load_config("configs/base.yaml")
    m, t = cfg.model, cfg.train
    assert (m.d_model, m.num_heads, m.num_encoder_layers, m.d_ff, m.dropout) == (512, 8, 6, 2048, 0.1)
    assert (t.betas, t.eps, t.warmup_steps, t.label_smoothing, t.schedule) == ([0.9, 0.98], 1e-9, 4000, 0.1, "noam")
    big = load_config("configs/big.yaml").model
    assert (big.d_model, big.num_heads, big.d_ff, big.dropout, big.num_encoder_layers) == (1024, 16, 4096, 0.3, 6)


def test_overrides_are_typed_by_the_schema():
    cfg = load_config("configs/small.yaml", ["train.lr=3e-4", "model.d_model=128", "train.max_time=60"])
    assert cfg.train.lr == 3e-4 and cfg.model.d_model == 128 and cfg.train.max_time == 60.0
    assert isinstance(cfg.train.max_time, float)
    with pytest.raises(ConfigError, match=r"train.lr: expected a number, got 'fast'"):
        load_config("configs/small.yaml", ["train.lr=fast"])
    # unquoted text that YAML reads as another type: the message says to quote it, and quoted it is text
    with pytest.raises(ConfigError, match=r"data.source: expected a string, got True \(YAML reads yes, no, on, off, "
                                          r"~ and numbers as other types\); put the text in quotes"):
        load_config("configs/small.yaml", ["data.source=yes"])
    assert load_config("configs/small.yaml", ["data.source='yes'"]).data.source == "yes"
    # a choice spelled as one of YAML's booleans (`train.accel: off`) is that choice, in --set as in a file
    assert load_config("configs/small.yaml", ["train.accel=off"]).train.accel == "off"
    with pytest.raises(ConfigError, match=r"train.accel: must be one of 'auto', 'off', got true "
                                          r"\(YAML reads on, yes, true as true\)$"):
        load_config("configs/small.yaml", ["train.accel=on"])
    assert load_config("configs/small.yaml", ["train.compile=false"]).train.compile is False


def test_numbers_past_what_torch_tokenizers_and_floats_hold_are_mistakes_not_tracebacks():
    huge = 2 ** 64  # YAML reads it as a Python integer, which torch could not take
    with pytest.raises(ConfigError) as info:
        load_config("configs/small.yaml", [f"model.max_len={huge}", f"train.max_steps=-{huge}",
                                           f"train.lr=1{'0' * 400}", "train.seed=-1", f"train.warmup_steps={2 ** 63 - 1}"])
    assert set(str(info.value).splitlines()) == {
        f"--set model.max_len: expected a 64-bit integer, got {huge}",
        f"--set train.max_steps: expected a 64-bit integer, got -{huge}",
        "--set train.lr: expected a finite number, got 100000000000000000...0000000000000000000",  # past float's range
        "--set train.seed: must be in [0, 2^32), got -1"}  # seeds are combined with epochs and ranks
    with pytest.raises(ConfigError, match=r"^--set data.min_frequency: must be >= 0, got -5$"):  # tokenizers' unsigned
        load_config("configs/small.yaml", ["data.min_frequency=-5"])
    assert load_config("configs/small.yaml", [f"train.seed={2 ** 32 - 1}"]).train.seed == 2 ** 32 - 1


def test_min_lr_is_a_rate_the_cosine_decays_to_from_lr():
    with pytest.raises(ConfigError) as info:
        load_config("configs/small.yaml", ["train.schedule=cosine", "train.lr=1e-3", "train.min_lr=-1e-4"])
    assert str(info.value) == "--set train.min_lr: must be >= 0, got -0.0001"  # the last steps would ascend
    with pytest.raises(ConfigError) as info:
        load_config("configs/small.yaml", ["train.schedule=cosine", "train.lr=1e-3", "train.min_lr=2e-3"])
    assert str(info.value) == ("--set train.min_lr: 0.002 is above train.lr 0.001, the peak that the cosine schedule "
                               "decays from; lower it")
    assert load_config("configs/small.yaml", ["train.schedule=cosine", "train.lr=1e-3", "train.min_lr=1e-3"])


def test_a_set_item_names_its_own_mistakes_and_reaches_into_mappings(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("configs/small.yaml", ["train.lr=fast", "model.dmodel=8", "model.d_model=0x", "a.b.c.d=1"])
    assert set(str(info.value).splitlines()) == {
        "--set 'a.b.c.d=1': expected section.key=value, e.g. --set train.lr=3e-4 (or section.key.entry=value "
        "for a mapping such as data.data_files.train)",
        "--set model.dmodel: unknown key; did you mean 'd_model'?",
        "--set model.d_model: expected an integer, got '0x'",
        "--set train.lr: expected a number, got 'fast'"}
    # a value check after the types: the file's own mistakes keep the file's name
    bad = tmp_path / "x.yaml"
    bad.write_text("train:\n  warmup_steps: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad, ["model.d_model=0"])
    assert set(str(info.value).splitlines()) >= {"--set model.d_model: must be > 0, got 0",
                                                 f"{bad}: train.warmup_steps: must be >= 0, got -1"}
    with pytest.raises(ConfigError) as info:
        load_config("configs/small.yaml", ["data.data_files.train=", "data.data_files.test=[]"])
    assert set(str(info.value).splitlines()) == {
        "--set data.data_files.train: expected a file name or a list of them, got None",
        "--set data.data_files.test: expected a file name or a list of them, got []"}
    cfg = load_config("configs/small.yaml", ["data.data_files.train=a.jsonl", "data.data_files.test=[b, c]"])
    assert cfg.data.data_files == {"train": "a.jsonl", "test": ["b", "c"]}
    with pytest.raises(ConfigError) as info:  # as in a file, a key given twice is a mistake, not an override
        load_config("configs/small.yaml", ["data.data_files={train: a.jsonl, train: b.jsonl}"])
    assert str(info.value) == "--set data.data_files: 'train' is given twice; keep one"
    assert load_config("configs/small.yaml", ["data.source=="]).data.source == "="  # what YAML cannot construct is text


def test_all_mistakes_are_reported_together(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  d_model: 500\n  num_head: 3\ntrain:\n  lr: -1\n  schedule: cosin\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    lines = str(info.value).splitlines()
    assert f"{bad}: model.num_head: unknown key; did you mean 'num_heads'?" in lines
    choices = "'noam', 'inverse_sqrt', 'cosine', 'constant'"
    assert f"{bad}: train.schedule: must be one of {choices}, got 'cosin'; did you mean 'cosine'?" in lines
    # values are checked beside wrong types and unknown keys, except by checks that name such a key: the
    # key meant (num_heads, at its default 8) or the one of the wrong type (d_model, at its default 512)
    assert f"{bad}: train.lr: must be > 0, got -1.0" in lines
    assert not [line for line in lines if "num_heads" in line and "unknown key" not in line]
    bad.write_text("model:\n  d_model: abc\n  num_heads: 7\ntrain:\n  lr: -1\n  max_tokens: 2\ndata:\n"
                   "  max_length: x\n")
    assert _mistakes(bad) == [f"{bad}: model.d_model: expected an integer, got 'abc'",
                              f"{bad}: data.max_length: expected an integer, got 'x'",
                              f"{bad}: train.lr: must be > 0, got -1.0"]
    bad.write_text("model: 5\ntrain:\n  lr: -1\n")
    assert _mistakes(bad) == [f"{bad}: model: expected a mapping of keys, got int",
                              f"{bad}: train.lr: must be > 0, got -1.0"]
    bad.write_text("model:\n  d_model: 500\n  word_dropout: -0.1\ndata:\n  bpe_dropout: 1\n"
                   "train:\n  lr: -1\n  rdrop: -0.5\n  ema_decay: 1\ndecode:\n  length_penalty: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    lines = str(info.value).splitlines()
    assert f"{bad}: model.num_heads: d_model 500 is not divisible by num_heads 8 (each head takes d_model / " \
           "num_heads channels); use d_model 496 or 504, or num_heads 10" in lines
    assert f"{bad}: train.lr: must be > 0, got -1.0" in lines
    assert f"{bad}: model.word_dropout: must be in [0, 1), got -0.1" in lines
    assert f"{bad}: decode.length_penalty: must be in [0, 10] (0: no length normalisation; 0.6 to 1 usual), got -1.0" in lines
    assert f"{bad}: data.bpe_dropout: must be in [0, 1), got 1.0" in lines
    assert f"{bad}: train.rdrop: must be >= 0 (0 turns R-Drop off), got -0.5" in lines
    assert f"{bad}: train.ema_decay: must be in [0, 1) (0 turns it off), got 1.0" in lines
    bad.write_text("model:\n  dropout: 0\ntrain:\n  rdrop: 1\n")
    with pytest.raises(ConfigError, match="train.rdrop: needs dropout"):
        load_config(bad)
    bad.write_text("data:\n  max_length: 256\ntrain:\n  step_tokens: 100\n  grad_accum: 2\n")
    lines = _mistakes(bad)
    assert (f"{bad}: train.step_tokens: 100 is smaller than one sequence (data.max_length 256); raise it, "
            "or null") in lines
    assert (f"{bad}: train.grad_accum: follows from train.step_tokens and max_tokens; leave it at 1, or set "
            "train.step_tokens=null") in lines
    bad.write_text("data:\n  subset: de-en\n  data_files:\n    train: t.jsonl\n")
    with pytest.raises(ConfigError, match="data.subset: selects a subset of data.dataset, not of data.data_files"):
        load_config(bad)


def _mistakes(path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value).splitlines()


def test_extends_merges_sections_and_round_trips(tmp_path):
    child = tmp_path / "child.yaml"
    (tmp_path / "parent.yaml").write_text("model:\n  d_model: 64\n  num_heads: 2\ntrain:\n  lr: 0.5\n  accel: off\n")
    child.write_text("extends: parent.yaml\nmodel:\n  num_heads: 4\n")
    cfg = load_config(child)
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.train.lr, cfg.model.d_ff) == (64, 4, 0.5, 256)
    assert cfg.train.accel == "off"
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again).model == cfg.model and load_config(again).train == cfg.train


def test_yaml_merge_keys_still_read_while_a_key_given_twice_is_refused(tmp_path):
    merged = tmp_path / "merged.yaml"  # a YAML merge overridden in the same mapping is not a key given twice
    merged.write_text("model:\n  <<: {d_model: 64, num_heads: 2}\n  num_heads: 4\n")
    assert (load_config(merged).model.d_model, load_config(merged).model.num_heads) == (64, 4)
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 0.5\n  warmup_steps: 7\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="line 4: 'lr' is given twice; keep one"):
        load_config(path)


def test_a_huge_value_is_quoted_short(tmp_path):
    # eight levels of YAML aliases, nine each: 43 million entries that are never built or printed
    lines, name = ['x0: &x0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'], "x0"
    for level in range(1, 8):
        lines.append(f"x{level}: &x{level} [{', '.join(['*' + name] * 9)}]")
        name = f"x{level}"
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("data:\n" + "".join(f"  {line}\n" for line in lines) + "  data_files: *x7\n"
                    f"  {'k' * 900}: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bomb, ["model.d_model=" + "9" * 3000 + "x"])
    assert "data.data_files: expected a mapping, got [[[...], [...], [...], [...], ...]," in str(info.value)
    assert "--set model.d_model: expected an integer, got '999" in str(info.value)
    assert "data.'kkkkk" in str(info.value)
    assert max(len(line.replace(str(bomb), "")) for line in str(info.value).splitlines()) < 200


def test_a_check_of_two_keys_names_the_one_the_command_line_set():
    """A check of two keys (d_model and num_heads; data.max_length and model.max_len) is the mistake of
    the one the command line set, not of the file that holds the other."""
    for sets, line in ((["model.d_model=130"], "--set model.d_model: d_model 130 is not divisible by num_heads 4"),
                       (["model.num_heads=3"], "--set model.num_heads: d_model 128 is not divisible by num_heads 3"),
                       (["model.d_model=130", "model.num_heads=3"], "--set model.num_heads: d_model 130 is not "
                                                                    "divisible by num_heads 3")):
        with pytest.raises(ConfigError) as info:
            load_config("configs/demo.yaml", sets)
        assert str(info.value).startswith(line + " (each head takes d_model / num_heads channels); use d_model ")
    # a key of another section is named in full; the check's own key then leads the problem
    with pytest.raises(ConfigError) as info:
        load_config("configs/demo.yaml", ["model.max_len=20"])
    assert str(info.value) == ("--set model.max_len: data.max_length 48 exceeds model.max_len 20; lower it or "
                               "raise model.max_len")
    with pytest.raises(ConfigError) as info:
        load_config("configs/demo.yaml", ["data.max_length=30000", "model.max_len=40000"])
    assert str(info.value) == ("--set data.max_length: train.max_tokens 3000 is smaller than one sequence "
                               "(data.max_length 30000); raise it")
    with pytest.raises(ConfigError, match=r"^--set model.positional: rope .* needs an even head size, got d_model "
                                          r"/ num_heads = 3; choose num_heads so that d_model / num_heads is even, "
                                          r"or another positional$"):
        load_config("configs/demo.yaml", ["model.positional=rope", "model.d_model=132", "model.num_heads=44"])
    with pytest.raises(ConfigError, match=r"use d_model 2305843009213000000 or 2305843009214000000$"):
        load_config(None, ["model.d_model=2305843009213693951", "model.num_heads=1000000"])  # a prime: no num_heads


def test_bad_config_through_the_cli_is_one_line_per_mistake_and_exit_1(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  d_model: 500\n")
    result = CliRunner().invoke(app, ["count-params", str(bad)])
    assert result.exit_code == 1
    assert f"error: {bad}: model.num_heads: d_model 500 is not divisible by num_heads 8" in result.output
    assert "Traceback" not in result.output
    missing = CliRunner().invoke(app, ["count-params", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 1 and "config file not found" in missing.output
    debug = CliRunner().invoke(app, ["--debug", "count-params", str(bad)])
    assert isinstance(debug.exception, ConfigError)
    device = CliRunner().invoke(app, ["train", "configs/demo.yaml", "--device", "gpu"])
    assert device.exit_code == 1 and device.output == "error: --device gpu: expected auto, cpu or cuda\n"
    # under torchrun, every process of a machine makes the same mistake: its first process says it
    for local_rank, said in (("0", True), ("3", False)):
        result = CliRunner().invoke(app, ["train", str(bad)], env={"LOCAL_RANK": local_rank})
        assert result.exit_code == 1 and ("not divisible" in result.output) == said, result.output


def test_a_data_files_split_that_would_break_the_line_is_shown_quoted(tmp_path):
    """A split named with a line break (found by the YAML property test) is one line, as an unknown key is."""
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump({"data": {"dataset": None, "data_files": {"tr\nain": None}}}))
    assert _mistakes(bad) == [f"{bad}: data.data_files.'tr\\nain': expected a file name or a list of them, got None"]


def test_a_data_files_split_named_by_a_number_is_a_config_error(tmp_path):
    """YAML reads `1: t.jsonl` as the number 1; reading the data then failed with a TypeError traceback."""
    bad = tmp_path / "c.yaml"
    bad.write_text("data:\n  dataset: null\n  data_files:\n    1: t.jsonl\n    train: t.jsonl\n")
    assert _mistakes(bad) == [f"{bad}: data.data_files.1: a split is named in text (train, validation, test); "
                              "quote it"]
