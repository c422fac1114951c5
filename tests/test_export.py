"""`tformer export --to hf`: the Marian model that transformers loads gives tformer's logits and outputs."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model_config
from tformer_cli.batching import pad_sequences
from tformer_cli.cli import app
from tformer_cli.config import Config
from tformer_cli.decoding import DecodeOptions, translate
from tformer_cli.errors import UsageError
from tformer_cli.export import check_marian, marian_config, marian_state_dict
from tformer_cli.model import build_model
from tformer_cli.runtime import load_run
from tformer_cli.tokenizer import BOS_ID, PAD_ID

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXTS = ["twenty-one", "three hundred forty-two thousand fifteen", "seven", "nine hundred ninety"]


def _logits(model, marian, src, tgt_in):
    with torch.no_grad():
        ours = model(src, tgt_in)
        theirs = marian(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt_in,
                        decoder_attention_mask=(tgt_in != 0).long()).logits
    real = tgt_in != 0
    return ours[real], theirs[real]


@pytest.mark.parametrize("bias, activation", [(False, "relu"), (True, "gelu")])
def test_the_marian_weights_give_tformers_teacher_forced_logits(bias, activation):
    config = Config(model=tiny_model_config(attention_bias=bias, activation=activation))
    model = build_model(config.model, 40).eval()
    if bias:  # biases trained away from zero, so that their placement is tested
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.1)
    marian = transformers.MarianMTModel(transformers.MarianConfig(**marian_config(config, 40))).eval()
    missing, unexpected = marian.load_state_dict(marian_state_dict(model, config.model.d_model), strict=False)
    assert not unexpected and all("embed_positions" in name for name in missing)
    src = torch.randint(4, 40, (3, 9))
    src[1, 5:], src[:, -1] = 0, 2
    tgt_in = torch.randint(4, 40, (3, 7))
    tgt_in[:, 0], tgt_in[2, 4:] = 1, 0
    ours, theirs = _logits(model, marian, src, tgt_in)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_an_exported_run_loads_in_transformers_and_translates_as_tformer_does(trained_run, tmp_path):
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(trained_run), str(out), "--to", "hf", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["folder"] == str(out)
    run = load_run(trained_run, accel="off")
    marian = transformers.MarianMTModel.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXTS)["input_ids"] == run.vocab.encode_sources(TEXTS)  # EOS appended, as tformer does
    src = pad_sequences(run.vocab.encode_sources(TEXTS))
    targets = pad_sequences(run.vocab.encode_targets(["einundzwanzig", "sieben", "neunhundert", "zwei"]))
    ours, theirs = _logits(run.model, marian, src, targets[:, :-1])
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    expected = translate(run.model, run.vocab, TEXTS, DecodeOptions(max_len_a=0, max_len_b=12))
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    generated = marian.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12)
    assert tokenizer.batch_decode(generated, skip_special_tokens=True) == [r.outputs[0][0] for r in expected]


def test_what_marian_cannot_express_is_refused_in_one_line(trained_run, tmp_path):
    run = load_run(trained_run, accel="off")
    for key, value, named in (("norm", "pre", "model.norm pre"), ("positional", "rope", "model.positional rope"),
                              ("share_embeddings", "decoder", "model.share_embeddings decoder")):
        config = Config(model=tiny_model_config(**{key: value}))
        with pytest.raises(UsageError, match=named):
            check_marian(config, run.vocab)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "taken")])
    assert result.exit_code == 1 and "not an empty folder" in result.output
    assert len(result.output.strip().splitlines()) == 1 and (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    other = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "x"), "--to", "onnx"])
    assert other.exit_code == 1 and "--to onnx" in other.output


def test_push_to_hub_uploads_the_exported_folder_and_a_failure_keeps_it(trained_run, tmp_path, monkeypatch):
    """The Hub cannot be reached here: its client is replaced by one that records what it was asked."""
    import huggingface_hub

    calls = []

    class Hub:
        def create_repo(self, repo, exist_ok=False):
            calls.append(("create", repo, exist_ok))

        def upload_folder(self, repo_id, folder_path):
            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    pushed = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "hf"), "--push-to-hub", "me/demo", "--json"])
    assert pushed.exit_code == 0, pushed.output
    assert json.loads(pushed.stdout)["pushed_to"] == "me/demo"
    assert calls == [("create", "me/demo", True), ("upload", "me/demo", sorted(p.name for p in (tmp_path / "hf").iterdir()))]

    class Offline(Hub):
        def create_repo(self, repo, exist_ok=False):
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    failed = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "hf2"), "--push-to-hub", "me/demo"])
    assert failed.exit_code == 1 and failed.stderr.strip() == (
        f"error: --push-to-hub me/demo: [Errno -2] Name or service not known; the export is in {tmp_path / 'hf2'}")
    assert (tmp_path / "hf2" / "model.safetensors").is_file()
    refused = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "ct2"), "--to", "ctranslate2",
                                  "--push-to-hub", "me/demo"])
    assert refused.exit_code == 1 and "only --to hf exports a Hub model" in refused.stderr


def _ct2_greedy(folder, vocab, texts, steps):
    import ctranslate2

    translator = ctranslate2.Translator(str(folder), device="cpu")
    tokens = [vocab.source_tokens(ids[:-1]) for ids in vocab.encode_sources(texts)]  # CTranslate2 adds EOS
    results = translator.translate_batch(tokens, beam_size=1, max_decoding_length=steps,
                                         suppress_sequences=[["<pad>"], ["<s>"]])  # as tformer never writes them
    return [[vocab.target.token_to_id(t) for t in r.hypotheses[0]] for r in results]


def test_a_ctranslate2_export_decodes_as_tformer_does(trained_run, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    result = runner.invoke(app, ["export", str(trained_run), str(out), "--to", "ctranslate2"])
    assert result.exit_code == 0, result.output
    run = load_run(trained_run, accel="off")
    expected = translate(run.model, run.vocab, TEXTS, DecodeOptions(max_len_a=0, max_len_b=12))
    assert _ct2_greedy(out, run.vocab, TEXTS, 12) == [r.outputs[0][1].tokens for r in expected]
    int8 = runner.invoke(app, ["export", str(trained_run), str(tmp_path / "int8"), "--to", "ctranslate2",
                               "--quantization", "int8"])
    assert int8.exit_code == 0, int8.output
    assert len(_ct2_greedy(tmp_path / "int8", run.vocab, TEXTS, 12)) == len(TEXTS)


@pytest.mark.parametrize("options", [dict(norm="pre", activation="gelu", attention_bias=True, positional="learned"),
                                     dict(norm="post", activation="relu", attention_bias=True)])
def test_ctranslate2_carries_pre_ln_gelu_biases_and_learned_positions(options, tmp_path):
    pytest.importorskip("ctranslate2")
    from tformer_cli.export import export_ctranslate2
    from tformer_cli.tokenizer import Vocabulary

    vocab = Vocabulary.train([("a b c d e f g h", "a b c d e f g h")] * 3, vocab_size=40, min_frequency=1)
    config = Config(model=tiny_model_config(**options))
    model = build_model(config.model, vocab.src_size).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    export_ctranslate2(model, config, vocab, tmp_path / "ct2")
    texts = ["a b c", "h g f e d", "c"]
    expected = translate(model, vocab, texts, DecodeOptions(max_len_a=0, max_len_b=10))
    assert _ct2_greedy(tmp_path / "ct2", vocab, texts, 10) == [r.outputs[0][1].tokens for r in expected]


def _generate(run, *args):
    result = runner.invoke(app, ["generate", str(run), *TEXTS, "--json", *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_generate_with_the_ctranslate2_engine_translates_as_tformer_does(trained_run):
    pytest.importorskip("ctranslate2")
    for args in (["--beam", "1"], ["--beam", "1", "--prefix", "ein"], ["--beam", "1", "--min-len", "3"],
                 ["--beam", "1", "--max-tokens", "8"],
                 ["--sample", "--top-p", "1e-300", "--seed", "1"]):  # p is 0 in float32: the likeliest token
        args = [*args, "--max-new-tokens", "12"]  # the same limit for every sentence (ctranslate2: per batch)
        ours, theirs = _generate(trained_run, *args), _generate(trained_run, *args, "--engine", "ctranslate2")
        assert [r["outputs"] for r in theirs] == [r["outputs"] for r in ours], args
        if len(args) == 4:  # tformer's scores count a forced prefix and are the model's log-probabilities;
            # CTranslate2 renormalizes over the tokens it may write (not padding nor the start symbol), which
            # can only raise them: here by less than 0.002 a token, over at most 13
            for mine, its in zip(ours, theirs):
                assert -1e-3 <= its["scores"][0] - mine["scores"][0] <= 0.002 * 13
    ours, theirs = (_generate(trained_run, "--beam", "1", "--min-len", "40", *engine)  # past every a * length + b
                    for engine in ([], ["--engine", "ctranslate2"]))
    assert [r["outputs"] for r in theirs] == [r["outputs"] for r in ours]
    assert all(len(r["output_tokens"][0]) == 40 for r in _generate(trained_run, "--min-len", "40", "--align"))
    beams = _generate(trained_run, "--beam", "4", "--nbest", "2", "--engine", "ctranslate2")
    assert all(len(r["outputs"]) == 2 for r in beams)
    assert len(_generate(trained_run, "--engine", "ctranslate2", "--precision", "int8")) == len(TEXTS)


def test_an_output_that_ctranslate2_ends_where_a_prefix_cut_mid_word_ends_is_warned_of_once(trained_run, monkeypatch):
    """CTranslate2 forces a prefix as its own tokens: "einund" gave "einund" where tformer's engine, which
    completes a word cut short, gave "einundzwanzig" (the demo run). Such an output is named once on
    stderr; one where the prefix ends with a space (a whole word) is not, nor any from tformer's engine."""
    pytest.importorskip("ctranslate2")
    from tformer_cli.ctranslate2_engine import CTranslate2Engine
    from tformer_cli.decoding import Hypothesis, Translation

    def stopping_at_the_prefix(self, texts, options, batch_size=None, prefixes=None, max_tokens=None):
        return [Translation(text, [(prefix, Hypothesis([], 0.0, 0.0))], False) for text, prefix in zip(texts, prefixes)]

    monkeypatch.setattr(CTranslate2Engine, "translate", stopping_at_the_prefix)
    for prefix, engine, warned in (("einund", "ctranslate2", 1), ("einund ", "ctranslate2", 0), ("einund", "tformer", 0)):
        result = runner.invoke(app, ["generate", str(trained_run), *TEXTS, "--prefix", prefix, "--engine", engine])
        assert result.exit_code == 0, result.output
        assert result.stderr.count("cannot complete a word cut short") == warned, (prefix, engine, result.stderr)
    assert result.stdout.splitlines()[0].startswith("einund")  # tformer's own decoding, not the stand-in


def test_neither_engine_writes_padding_or_the_start_symbol_where_the_model_likes_them(trained_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    pytest.importorskip("ctranslate2")
    run = tmp_path / "likes-specials"
    shutil.copytree(trained_run, run)
    weights = load_file(str(run / "model.safetensors"))
    weights["decoder.embed.embedding.weight"][PAD_ID:BOS_ID + 1] *= 30  # the tied output rows: each step's likeliest
    save_file(weights, str(run / "model.safetensors"))
    ours = _generate(run, "--beam", "1", "--max-new-tokens", "12", "--align")  # ctranslate2: one limit a batch
    assert ours[0]["output_tokens"][0] and not {"<pad>", "<s>"} & {t for r in ours for t in r["output_tokens"][0]}
    theirs = _generate(run, "--beam", "1", "--max-new-tokens", "12", "--engine", "ctranslate2")
    assert [r["outputs"] for r in theirs] == [r["outputs"] for r in ours]


@pytest.mark.parametrize("flags, named", [(["--engine", "onnx"], "--engine onnx"),
                                          (["--engine", "ctranslate2", "--align"], "--align"),
                                          (["--engine", "ctranslate2", "--mbr", "4"], "--mbr"),
                                          (["--engine", "ctranslate2", "--precision", "fp8"], "--precision fp8")])
def test_generate_refuses_what_the_ctranslate2_engine_cannot_do(trained_run, flags, named):
    result = runner.invoke(app, ["generate", str(trained_run), "seven", *flags])
    assert result.exit_code != 0
    assert named in result.output and len(result.output.strip().splitlines()) == 1
