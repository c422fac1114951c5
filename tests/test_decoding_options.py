"""Ensembles, repetition control, forced prefixes, alignments and minimum-Bayes-risk decoding, each
against a reference: recomputation without a cache, sacreBLEU's own scores, the single model."""

import json
import math
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model_config
from tformer_cli.cli import app
from tformer_cli.decoding import DecodeOptions, beam_search, decode_batch, greedy_or_sample, translate
from tformer_cli.decoding_rules import Pieces, Prefix, max_new_tokens
from tformer_cli.ensemble import Ensemble
from tformer_cli.mbr import expected_utilities, rank, sentence_metric
from tformer_cli.model import build_model
from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, Vocabulary

VOCAB = 24
LIMIT = dict(max_len_a=0, max_len_b=10)
runner = CliRunner()


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(tiny_model_config(), VOCAB).eval()
    with torch.no_grad():  # EOS reasonably likely, so that sentences finish at different steps
        model.output_proj.weight[EOS_ID] *= 3
    return model


def _sources():
    src = torch.randint(4, VOCAB, (5, 7), generator=torch.Generator().manual_seed(1))
    src[:, -1] = EOS_ID
    src[1, 3:] = PAD_ID
    src[3, 5:] = PAD_ID
    return src


def _trim(row):
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


@torch.no_grad()
def _uncached_greedy(models, src, steps, start=None):
    """Reference: recompute every prefix without a cache, averaging the models' probabilities;
    ``start`` (B, P) tokens are forced first."""
    ys = torch.full((src.shape[0], 1), BOS_ID)
    for t in range(steps):
        probs = torch.stack([m(src, ys)[:, -1].softmax(-1) for m in models]).mean(0)
        token = probs.argmax(-1)
        if start is not None and t < start.shape[1]:
            token = start[:, t]
        ys = torch.cat([ys, token[:, None]], dim=1)
    return [_trim(row) for row in ys[:, 1:].tolist()]


# ---------------------------------------------------------------------------------------------
# Ensembles
# ---------------------------------------------------------------------------------------------

def test_an_ensemble_of_one_model_or_of_a_model_with_itself_equals_that_model():
    model, src = _model(), _sources()
    for options in (DecodeOptions(**LIMIT), DecodeOptions(beam_size=4, nbest=2, **LIMIT)):
        alone = decode_batch(model, src, options)
        for ensemble in (Ensemble([model]), Ensemble([model, model])):
            together = decode_batch(ensemble, src, options)
            assert [[h.tokens for h in hyps] for hyps in together] == [[h.tokens for h in hyps] for hyps in alone]
            for a, b in zip(together, alone):
                assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_an_ensemble_decodes_the_average_of_its_models_probabilities():
    models, src = [_model(0), _model(1), _model(2)], _sources()
    ours = greedy_or_sample(Ensemble(models), src, DecodeOptions(**LIMIT))
    assert [h.tokens for h in ours] == _uncached_greedy(models, src, 10)
    assert [h.tokens for h in ours] != [h.tokens for h in greedy_or_sample(models[0], src, DecodeOptions(**LIMIT))]
    beam = beam_search(Ensemble(models), src, DecodeOptions(beam_size=1, length_penalty=0.0, **LIMIT))
    assert [hyps[0].tokens for hyps in beam] == [h.tokens for h in ours]


# ---------------------------------------------------------------------------------------------
# Repetition control and minimum length
# ---------------------------------------------------------------------------------------------

def _repeating_model():
    """A model whose every step predicts the same distribution: token 5, then 6, 7, 8 ... (EOS last)."""
    model = build_model(tiny_model_config(), VOCAB).eval()
    final = model.decoder.layers[-1].norm3  # post-LN: the decoder's output is this norm's bias alone
    with torch.no_grad():
        final.weight.zero_()
        final.bias.copy_(torch.linspace(-1, 1, final.bias.numel()))
        preference = torch.zeros(VOCAB)
        preference[4:] = torch.linspace(2.0, 1.0, VOCAB - 4)  # token 4 first, then 5, 6, ...
        preference[EOS_ID] = -5.0
        model.output_proj.weight.copy_(preference[:, None] * final.bias[None, :] / final.bias.square().sum())
    return model


def _ngrams(tokens, n):
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_forbids_every_repeated_ngram_in_greedy_beam_and_sampling(n):
    model, src = _repeating_model(), _sources()
    plain = greedy_or_sample(model, src, DecodeOptions(**LIMIT))
    assert all(h.tokens == [4] * 10 for h in plain)  # the model repeats itself
    searches = [DecodeOptions(**LIMIT), DecodeOptions(beam_size=3, nbest=3, **LIMIT),
                DecodeOptions(sample=True, temperature=3.0, seed=1, nbest=4, **LIMIT)]
    for options in searches:
        options.no_repeat_ngram = n
        for hyps in decode_batch(model, src, options):
            for hyp in hyps:
                assert len(hyp.tokens) == 10 and max(_ngrams(hyp.tokens, n).values()) == 1
    greedy = greedy_or_sample(model, src, DecodeOptions(no_repeat_ngram=n, **LIMIT))[0].tokens
    assert greedy == _greedy_without_repeats(n, 10)


def _greedy_without_repeats(n, length):
    """Reference for the repeating model: at each step, the most preferred token (4, 5, ...) whose
    n-gram with the last n - 1 tokens has not occurred yet."""
    out = []
    for _ in range(length):
        seen = set(_ngrams(out, n))
        out.append(next(tok for tok in range(4, VOCAB) if tuple(out[len(out) - n + 1:] + [tok]) not in seen))
    return out


def test_min_len_holds_for_greedy_beam_and_sampling_also_past_the_length_limit_which_it_raises():
    model, src = _model(), _sources()
    for limit in (9, 4):  # 4: a limit below min_len, raised to it (within the model's positions)
        for options in (DecodeOptions(min_len=9, max_len_a=0, max_len_b=limit),
                        DecodeOptions(beam_size=3, min_len=9, max_len_a=0, max_len_b=limit),
                        DecodeOptions(sample=True, seed=2, nbest=3, min_len=9, max_len_a=0, max_len_b=limit)):
            assert all(len(h.tokens) == 9 for hyps in decode_batch(model, src, options) for h in hyps)
    free = [len(h.tokens) for h in greedy_or_sample(model, src, DecodeOptions(**LIMIT))]
    assert min(free) < 9
    assert max_new_tokens(src, PAD_ID, DecodeOptions(min_len=90), 64).tolist() == [63] * len(src)


def test_a_length_limit_past_int64_is_the_models_positions_not_one_token():
    src = _sources()  # a * length + b wrapped to int64's most negative when cast, then rose to min_len 1
    for options in (DecodeOptions(max_len_a=1e30), DecodeOptions(max_len_a=0, max_len_b=2 ** 63 - 1)):
        assert max_new_tokens(src, PAD_ID, options, 64).tolist() == [63] * len(src)


def test_where_the_ngram_ban_leaves_only_eos_before_min_len_the_output_ends_there():
    """With no token twice and EOS forbidden for 30 tokens, a vocabulary of VOCAB tokens runs out after
    its VOCAB - 3 that may be written (not EOS, padding nor the start symbol): each search then ends the
    sentence (it used to pick a -inf token, return no hypothesis, or fail in sampling)."""
    model, src = _model(), _sources()
    for options in (DecodeOptions(no_repeat_ngram=1, min_len=30, max_len_a=0, max_len_b=30),
                    DecodeOptions(beam_size=3, nbest=2, no_repeat_ngram=1, min_len=30, max_len_a=0, max_len_b=30),
                    DecodeOptions(sample=True, seed=2, no_repeat_ngram=1, min_len=30, max_len_a=0, max_len_b=30)):
        for hyps in decode_batch(model, src, options):
            assert len(hyps) == options.nbest
            for h in hyps:
                assert sorted(h.tokens) == [tok for tok in range(VOCAB) if tok not in (EOS_ID, PAD_ID, BOS_ID)]
                assert math.isfinite(h.score)


def test_no_search_writes_padding_or_the_start_symbol_even_where_the_model_likes_them():
    """Neither is ever a target; fairseq forbids padding too (sampling wrote both, from a trained model)."""
    model, src = _model(), _sources()
    with torch.no_grad():
        model.output_proj.weight[PAD_ID:BOS_ID + 1] *= 8
    for options in (DecodeOptions(**LIMIT), DecodeOptions(beam_size=3, nbest=2, **LIMIT),
                    DecodeOptions(sample=True, seed=1, nbest=4, temperature=2.0, **LIMIT),
                    DecodeOptions(min_len=4, no_repeat_ngram=2, **LIMIT)):
        tokens = {t for hyps in decode_batch(model, src, options) for h in hyps for t in h.tokens}
        assert tokens and not {PAD_ID, BOS_ID} & tokens, options


# ---------------------------------------------------------------------------------------------
# Forced prefixes
# ---------------------------------------------------------------------------------------------

# A target vocabulary of VOCAB pieces for the tiny model, with several ways to spell most texts
PIECES = [None] * 4 + ["▁a", "▁ab", "▁abc", "a", "b", "c", "bc", "▁b", "▁ba", "▁", "ab", "ca", "▁c", "cab",
                       "abc", "ba", "bb", "▁bb", "cc", "▁cc"]
# per source row: the prefix spelled in pieces; rows 1 and 3 have none; row 4 ends in a space
PREFIXES = ["▁ab", "", "▁cab▁b", "", "▁c▁"]


def _spelled(tokens):
    return "".join(PIECES[t] or "" for t in tokens)


@torch.no_grad()
def _uncached_greedy_with_prefix(model, src, prefix, steps=10):
    """Reference: recompute every step without a cache; while the output's text is shorter than the
    prefix, take the likeliest token that keeps the text and the prefix one the beginning of the other."""
    ys = [BOS_ID]
    for _ in range(steps):
        log_probs = model(src, torch.tensor([ys]))[0, -1].log_softmax(-1)
        written = _spelled(ys[1:])
        if len(written) < len(prefix):
            fits = [PIECES[t] is not None and (prefix.startswith(written + PIECES[t])
                                                or (written + PIECES[t]).startswith(prefix)) for t in range(VOCAB)]
            log_probs = log_probs.masked_fill(~torch.tensor(fits), float("-inf"))
        ys.append(int(log_probs.argmax()))
    return _trim(ys[1:])


def test_outputs_start_with_their_prefix_spelled_as_the_model_chooses_as_without_a_cache():
    model, src = _model(), _sources()
    prefix = Prefix(Pieces(PIECES), PREFIXES)
    ours = greedy_or_sample(model, src, DecodeOptions(**LIMIT), prefix)
    expected = [_uncached_greedy_with_prefix(model, src[i:i + 1], PREFIXES[i]) for i in range(5)]
    assert [h.tokens for h in ours] == expected
    assert all(_spelled(h.tokens).startswith(text) for h, text in zip(ours, PREFIXES))
    plain = greedy_or_sample(model, src, DecodeOptions(**LIMIT))
    assert ours[1].tokens == plain[1].tokens and ours[3].tokens == plain[3].tokens
    with torch.no_grad():  # the score is the model's log-probability of the whole output, prefix included
        target = ours[0].tokens + ([EOS_ID] if len(ours[0].tokens) < 10 else [])
        log_probs = model(src[:1], torch.tensor([[BOS_ID] + target[:-1]])).log_softmax(-1)[0]
        assert ours[0].score == pytest.approx(log_probs[torch.arange(len(target)), torch.tensor(target)].sum().item(),
                                              abs=1e-4)
    beams = beam_search(model, src, DecodeOptions(beam_size=4, nbest=4, **LIMIT), prefix)
    for text, hyps in zip(PREFIXES, beams):
        assert len(hyps) == 4 and all(_spelled(h.tokens).startswith(text) for h in hyps)
        assert all(h.score > float("-inf") for h in hyps)
    assert len({tuple(h.tokens[:2]) for h in beams[0]}) > 1  # the beams spell "▁ab" in more ways than one
    one_beam = beam_search(model, src, DecodeOptions(beam_size=1, length_penalty=0.0, **LIMIT), prefix)
    assert [hyps[0].tokens for hyps in one_beam] == expected
    sampled = decode_batch(model, src, DecodeOptions(sample=True, seed=3, nbest=3, **LIMIT), prefix)
    assert all(_spelled(h.tokens).startswith(text) for text, hyps in zip(PREFIXES, sampled) for h in hyps)


def test_a_prefix_overrides_the_repetition_ban_and_min_len_while_it_lasts():
    model, src = _model(), _sources()[:1]
    prefix = Prefix(Pieces(PIECES), ["▁a▁a▁a"])
    out = greedy_or_sample(model, src, DecodeOptions(no_repeat_ngram=1, min_len=8, **LIMIT), prefix)
    assert _spelled(out[0].tokens).startswith("▁a▁a▁a") and out[0].score > float("-inf")


def test_a_prefix_that_no_token_can_spell_leaves_its_row_free():
    model, src = _model(), _sources()[:2]
    out = greedy_or_sample(model, src, DecodeOptions(**LIMIT), Prefix(Pieces(PIECES), ["▁ab", "d"]))
    assert out[1].tokens == greedy_or_sample(model, src, DecodeOptions(**LIMIT))[1].tokens


def test_a_prefix_past_the_length_limit_still_leaves_room_for_one_token():
    model, src = _model(), _sources()[:1]
    out = greedy_or_sample(model, src, DecodeOptions(max_len_a=0, max_len_b=2), Prefix(Pieces(PIECES), ["▁abc▁abc"]))
    assert _spelled(out[0].tokens).startswith("▁abc▁abc")


# ---------------------------------------------------------------------------------------------
# Alignments
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def _reference_alignment(model, src_row, tokens, layer):
    """Each output token's most attended real source token, from the whole output decoded at once."""
    encoded = model.encode(src_row[None])
    tgt = torch.tensor([[BOS_ID] + tokens])
    weights = model.decode(tgt[:, :-1] if tokens else tgt, encoded, need_weights=True).cross_attention[layer]
    weights = weights[0].mean(0)  # (T, S): averaged over heads
    real = (src_row != PAD_ID) & (src_row != EOS_ID)
    return weights.masked_fill(~real, -1.0).argmax(-1).tolist()[:len(tokens)]


@pytest.mark.parametrize("layer", [0, 1])
def test_alignments_are_the_most_attended_source_tokens_in_greedy_and_beam(layer):
    model, src = _model(), _sources()
    greedy = greedy_or_sample(model, src, DecodeOptions(align_layer=layer, **LIMIT))
    beams = beam_search(model, src, DecodeOptions(beam_size=3, nbest=3, align_layer=layer, **LIMIT))
    for row, hyp, hyps in zip(src, greedy, beams):
        assert hyp.alignment == _reference_alignment(model, row, hyp.tokens, layer)
        for h in hyps:  # beams were reordered and pruned along the way
            assert h.alignment == _reference_alignment(model, row, h.tokens, layer)
            real = int(((row != PAD_ID) & (row != EOS_ID)).sum())
            assert all(0 <= s < real for s in h.alignment)
    assert greedy_or_sample(model, src, DecodeOptions(**LIMIT))[0].alignment is None


# ---------------------------------------------------------------------------------------------
# Minimum-Bayes-risk decoding
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chrf", "bleu"])
def test_expected_utility_is_the_mean_sacrebleu_sentence_score_against_every_candidate(name):
    candidates = ["a man rides a bike", "a man rides a bicycle", "a man rides a bike", "two dogs play", ""]
    metric = sentence_metric(name)
    expected = [sum(metric.sentence_score(h, [r]).score for r in candidates) / len(candidates) for h in candidates]
    assert expected_utilities(candidates, metric) == pytest.approx(expected)
    order, utilities = rank(candidates, metric)
    assert candidates[order[0]] == "a man rides a bike" and utilities == sorted(utilities, reverse=True)
    assert sorted(order) == [0, 1, 3, 4]  # each distinct candidate once, at its first occurrence


def test_mbr_translation_is_the_sampled_candidate_of_highest_expected_utility():
    model = _model()
    vocab = Vocabulary.train([("a b c d e f", "a b c d e f")] * 3, vocab_size=VOCAB, min_frequency=1)
    texts = ["a b c", "d e", "f a b c d"]
    options = DecodeOptions(mbr=6, seed=4, nbest=2, max_len_a=0, max_len_b=6)
    results = translate(model, vocab, texts, options)
    candidates = translate(model, vocab, texts, options.candidates())  # the same seed draws the same samples
    metric = sentence_metric("chrf")
    for result, drawn in zip(results, candidates):
        texts_drawn = [text for text, _ in drawn.outputs]
        assert len(texts_drawn) == 6 and len(result.outputs) == 2
        utilities = expected_utilities(texts_drawn, metric)
        assert result.outputs[0][0] == texts_drawn[max(range(6), key=lambda i: utilities[i])]
        assert result.utilities[0] == pytest.approx(max(utilities))
    beam = translate(model, vocab, texts, DecodeOptions(mbr=4, mbr_candidates="beam", beam_size=2, **LIMIT))
    n_best = translate(model, vocab, texts, DecodeOptions(beam_size=4, nbest=4, **LIMIT))
    for result, drawn in zip(beam, n_best):
        assert result.outputs[0][0] in [text for text, _ in drawn.outputs]


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def _json_lines(output):
    return [json.loads(line) for line in output.splitlines()]


def test_greedy_output_cut_anywhere_and_given_as_prefix_is_completed_to_itself(trained_run):
    """Greedy decoding's own tokens fit any beginning of its output, and each is the likeliest of all, so
    with that beginning as the prefix it must come out again, score and all: also where the cut falls
    inside a word, or inside a token, or after a space."""
    texts = ["twenty-one", "three hundred forty-two", "seven", "ninety-nine thousand"]
    greedy = ["--beam", "1", "--json"]
    plain = _json_lines(runner.invoke(app, ["generate", str(trained_run), *texts, *greedy]).stdout)
    cuts = [(line["input"], line["outputs"][0][:k], line) for line in plain for k in range(1, len(line["outputs"][0]))]
    assert len(cuts) > 20
    lines = "".join(json.dumps({"input": text, "prefix": cut}) + "\n" for text, cut, _ in cuts)
    result = runner.invoke(app, ["generate", str(trained_run), "--json-input", *greedy], input=lines)
    assert result.exit_code == 0, result.output
    for (_, cut, expected), got in zip(cuts, _json_lines(result.stdout)):
        assert got["outputs"] == expected["outputs"], cut
        assert got["scores"] == pytest.approx(expected["scores"], abs=1e-3), cut


def test_generate_with_a_prefix_alignment_and_mbr_from_the_command_line(trained_run):
    run = str(trained_run)
    plain = runner.invoke(app, ["generate", run, "twenty-one", "seven", "--prefix", "ein", "--json"])
    assert plain.exit_code == 0, plain.output
    assert all(line["outputs"][0].startswith("ein") for line in _json_lines(plain.stdout))
    lines = '{"input": "twenty-one", "prefix": "zwei"}\n{"input": "seven"}\n'
    piped = runner.invoke(app, ["generate", run, "--json-input", "--json"], input=lines)
    assert piped.exit_code == 0, piped.output
    first, second = _json_lines(piped.stdout)
    assert first["outputs"][0].startswith("zwei") and second["input"] == "seven"
    # a prefix the target vocabulary cannot spell would lose its unknown token from the output
    unspellable = runner.invoke(app, ["generate", run, "seven", "--prefix", "zw€i"])
    assert unspellable.exit_code == 1 and "no token for '€'" in unspellable.output, unspellable.output
    piped = runner.invoke(app, ["generate", run, "--json-input"], input='{"input": "seven", "prefix": "€"}\n')
    assert piped.exit_code == 1 and "line 1: prefix" in piped.output, piped.output
    # a key of the caller's own is left alone; one spelt almost like "prefix" would lose the prefix unseen
    piped = runner.invoke(app, ["generate", run, "--json-input"], input='{"id": 3, "input": "seven"}\n')
    assert piped.exit_code == 0 and len(piped.stdout.splitlines()) == 1, piped.output
    piped = runner.invoke(app, ["generate", run, "--json-input"], input='{"input": "seven"}\n{"input": "x", "prefx": "z"}\n')
    assert piped.exit_code == 1 and "line 2: unknown key 'prefx'; did you mean 'prefix'?" in piped.output, piped.output
    aligned = runner.invoke(app, ["generate", run, "twenty-one", "three hundred", "--align"])
    assert aligned.exit_code == 0, aligned.output
    out = aligned.stdout.splitlines()
    assert len(out) == 4 and out[1].startswith("A-0\t") and out[3].startswith("A-1\t")
    pairs = [tuple(map(int, p.split("-"))) for p in out[1].split("\t")[1].split()]
    assert [t for _, t in pairs] == list(range(len(pairs)))
    as_json = _json_lines(runner.invoke(app, ["generate", run, "twenty-one", "--align", "--json", "--beam", "3",
                                              "--nbest", "2", "--align-layer", "1"]).stdout)[0]
    assert len(as_json["alignments"]) == 2
    for pairs, tokens in zip(as_json["alignments"], as_json["output_tokens"]):
        assert len(pairs) == len(tokens) and all(s < len(as_json["source_tokens"]) for s, _ in pairs)
    mbr = runner.invoke(app, ["generate", run, "twenty-one", "--mbr", "8", "--nbest", "3", "--seed", "1", "--json"])
    assert mbr.exit_code == 0, mbr.output
    utilities = _json_lines(mbr.stdout)[0]["mbr_utilities"]
    assert len(utilities) == 3 and utilities == sorted(utilities, reverse=True)


def test_eval_with_an_ensemble_no_repeat_ngram_and_mbr(trained_run):
    run = str(trained_run)
    args = ["eval", run, "--split", "validation", "--max-samples", "12", "--beam", "2", "--json"]
    alone = json.loads(runner.invoke(app, args).stdout)
    doubled = runner.invoke(app, args + ["--ensemble", run])
    assert doubled.exit_code == 0, doubled.output
    doubled = json.loads(doubled.stdout)
    assert doubled["ensemble"] == [run, run]
    for key in ("bleu", "chrf", "loss"):
        assert doubled[key] == pytest.approx(alone[key], abs=1e-4)
    constrained = runner.invoke(app, args + ["--no-repeat-ngram", "2", "--min-len", "2"])
    assert constrained.exit_code == 0, constrained.output
    mbr = runner.invoke(app, args + ["--mbr", "4", "--mbr-metric", "bleu", "--seed", "1"])
    assert mbr.exit_code == 0, mbr.output
    assert json.loads(mbr.stdout)["mbr"] == 4
    table = runner.invoke(app, args[:-1] + ["--ensemble", run, "--mbr", "3", "--mbr-candidates", "beam"])
    assert table.exit_code == 0, table.output
    title = " ".join(table.stdout.split())  # the table's title wraps at the terminal's width
    assert "+ 1 more (ensemble) · validation · MBR over 3 beam hypotheses (chrf)" in title


def test_an_ensemble_with_fewer_positions_than_the_first_runs_data_cuts_inputs_to_them(trained_run, tmp_path):
    """The same weights as a run of 16 positions (sinusoidal: the table is not saved): ensembled with the
    full run, eval's loss and scores and generate's outputs are those of the short run alone, whose
    pairs and inputs are cut at 16 tokens."""
    import shutil

    import yaml

    short = tmp_path / "short"
    shutil.copytree(trained_run, short)
    config = yaml.safe_load((short / "config.yaml").read_text())
    config["model"]["max_len"] = config["data"]["max_length"] = 16
    (short / "config.yaml").write_text(yaml.safe_dump(config))
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"en": " ".join(["seven"] * n), "de": " ".join(["sieben"] * n)}) + "\n"
                            for n in (3, 20, 30)))
    alone = runner.invoke(app, ["eval", str(short), "--data-files", str(data), "--beam", "2", "--json"])
    assert alone.exit_code == 0, alone.output
    together = runner.invoke(app, ["eval", str(trained_run), "--ensemble", str(short), "--data-files", str(data),
                                   "--beam", "2", "--json"])
    assert together.exit_code == 0, together.output
    alone, together = json.loads(alone.stdout), json.loads(together.stdout)
    for key in ("loss", "bleu", "chrf"):
        assert together[key] == pytest.approx(alone[key], abs=1e-4), key
    text = " ".join(["seven"] * 30)
    alone = runner.invoke(app, ["generate", str(short), text])
    together = runner.invoke(app, ["generate", str(trained_run), "--ensemble", str(short), text])
    assert together.exit_code == 0 and together.stdout == alone.stdout
    assert "input longer than the model's 16 positions was truncated" in together.stderr


@pytest.mark.parametrize("engine", ["tformer", "ctranslate2"])
def test_a_prefix_past_the_models_positions_is_cut_there_with_a_warning(trained_run, engine):
    """The output holds what of the prefix fits the model's 64 positions, and stderr says so (the
    ctranslate2 engine failed with a traceback); a prefix that fits gets no warning."""
    if engine == "ctranslate2":
        pytest.importorskip("ctranslate2")
    prefix = "sieben " * 80
    long = runner.invoke(app, ["generate", str(trained_run), "seven", "--prefix", prefix, "--engine", engine])
    assert long.exit_code == 0, long.output
    output = long.stdout.strip()
    assert output and prefix.startswith(output) and len(output) < len(prefix)
    assert "the model's 64 positions ran out inside the prefix" in long.stderr
    short = runner.invoke(app, ["generate", str(trained_run), "seven", "--prefix", "sieben ", "--engine", engine])
    assert short.exit_code == 0 and short.stdout.startswith("sieben") and not short.stderr


def test_decoding_mistakes_get_one_line(trained_run, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(trained_run, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # two tokens swap ids: the same size, another vocabulary
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    run = str(trained_run)
    cases = {
        ("generate", run, "seven", "--ensemble", str(other)): "vocabulary differs",
        ("generate", run, "seven", "--no-repeat-ngram", "-1"): "--no-repeat-ngram -1",
        ("generate", run, "seven", "--align", "--align-layer", "9"): "--align-layer 9",
        ("generate", run, "seven", "--mbr", "2", "--nbest", "3"): "--nbest 3 with --mbr 2",
        ("generate", run, "seven", "--mbr", "4", "--mbr-metric", "ter"): "--mbr-metric ter",
        ("generate", run, "--json-input"): "line 1: not JSON",
        ("generate", run, "seven", "--sample", "--mbr", "4", "--mbr-candidates", "beam"):
            "--sample with --mbr-candidates",
    }
    for args, message in cases.items():
        result = runner.invoke(app, list(args), input="twenty-one\n")
        assert result.exit_code == 1 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    # JSON escapes half of a UTF-16 pair, which Python reads as a lone surrogate that tokenizers refused
    for line, message in (('{"input": "bad \\ud800"}', "line 1: input: character 5 is half of a UTF-16 pair "
                                                         "('\\ud800'), not a character; escape whole characters"),
                          ('{"input": "seven", "prefix": "\\udfff"}', "line 1: prefix: character 1 is half")):
        result = runner.invoke(app, ["generate", run, "--json-input"], input=line + "\n")
        assert result.exit_code == 1 and message in result.output, (line, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    result = runner.invoke(app, ["generate", run, "--json-input"], input='{"input": "seven \\ud83d\\ude00"}\n')
    assert result.exit_code == 0  # a whole pair: one character


def test_epsilon_sampling_draws_only_tokens_of_at_least_that_probability():
    from tformer_cli.decoding import _sample

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01], [0.02, 0.03, 0.05, 0.4, 0.5]]).repeat(2000, 1)
    options = DecodeOptions(sample=True, epsilon=0.1)
    drawn = _sample(probs.log(), options, torch.Generator().manual_seed(0)).view(2000, 2)
    assert set(drawn[:, 0].tolist()) == {0, 1, 2} and set(drawn[:, 1].tolist()) == {3, 4}
    flat = torch.full((1, 5), 0.2)  # none reaches epsilon: the most likely token stays
    assert _sample(flat.log(), DecodeOptions(sample=True, epsilon=0.5), None).item() == 0


def test_mbr_samples_are_epsilon_samples_unless_epsilon_is_set():
    assert DecodeOptions(mbr=8).candidates().epsilon == 0.02
    assert DecodeOptions(mbr=8, epsilon=0.0).candidates().epsilon == 0.0
    assert DecodeOptions(mbr=8, epsilon=0.1).candidates().epsilon == 0.1
    beam = DecodeOptions(mbr=8, mbr_candidates="beam", beam_size=4).candidates()
    assert (beam.sample, beam.beam_size, beam.nbest, beam.mbr) == (False, 8, 8, 0)
