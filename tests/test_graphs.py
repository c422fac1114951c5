"""The graphed greedy step (accel/graphs.py) against the plain greedy loop. On a CPU the step runs
eagerly (``capture=False``): the same preallocated cache, tensor-held position, masks and in-place
bookkeeping that the CUDA graph records; tests/test_cuda.py replays it as a graph."""

import pytest
import torch

from conftest import tiny_model_config
from tformer_cli.accel import graphs
from tformer_cli.decoding import DecodeOptions, _greedy_loop, beam_search, greedy_or_sample
from tformer_cli.decoding_rules import max_new_tokens
from tformer_cli.ensemble import Ensemble, as_ensemble
from tformer_cli.model import build_model
from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID

VOCAB = 24


def _model(seed: int, **overrides):
    """A random tiny model (fp64: no near-ties between float orders of summation) whose EOS weight is
    scaled until greedy outputs of ``_sources`` end with EOS at several different steps."""
    torch.manual_seed(seed)
    model = build_model(tiny_model_config(**overrides), VOCAB).double().eval()
    eos = model.output_proj.weight[EOS_ID].detach().clone()
    options = DecodeOptions(max_len_a=1.0, max_len_b=4)
    limits = max_new_tokens(_sources(), 0, options, 64).tolist()
    for scale in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0):
        with torch.no_grad():
            model.output_proj.weight[EOS_ID] = eos * scale
        lengths = [len(h.tokens) for h in greedy_or_sample(model, _sources(), options)]
        if len(set(lengths)) > 2 and any(n < limit for n, limit in zip(lengths, limits)):
            return model
    raise AssertionError("no EOS scale ends these sentences at several steps")


def _sources(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (6, 9), generator=generator)
    src[:, -1] = EOS_ID
    src[1, 4:] = 0  # padding: the memory mask is used
    src[4, 6:] = 0
    return src


def _both(model, src, options):
    models = as_ensemble(model)
    limits = max_new_tokens(src, models.pad_id, options, models.max_len)
    encoded = models.encode(src)
    with torch.no_grad():
        graphed = graphs.greedy(models, encoded, limits, options.min_len, capture=False)
        plain = _greedy_loop(models, src, encoded, limits, options, None)[:3]
    return graphed, plain


@pytest.mark.parametrize("overrides", [
    {},
    {"norm": "pre", "activation": "gelu"},
    {"positional": "learned", "attention_bias": True},
    {"share_embeddings": "none", "num_decoder_layers": 3},
    {"positional": "rope"},
    {"positional": "alibi", "norm": "pre"},
])
@pytest.mark.parametrize("min_len", [0, 3])
def test_the_static_step_gives_the_plain_loops_tokens_lengths_and_scores(overrides, min_len):
    model = _model(1, **overrides)
    src, options = _sources(), DecodeOptions(max_len_a=1.0, max_len_b=4, min_len=min_len)
    graphed, plain = _both(model, src, options)
    out, lengths, scores = graphed
    assert lengths.tolist() == plain[1].tolist()
    for row, n, reference in zip(out.tolist(), lengths.tolist(), plain[0].tolist()):
        assert row[:n] == reference[:n]
        assert all(t == EOS_ID for t in row[n:])  # finished sentences emit EOS after their end
    torch.testing.assert_close(scores, plain[2], rtol=1e-9, atol=1e-9)


def test_an_ensemble_steps_like_the_plain_loop():
    ensemble = Ensemble([_model(1), _model(2)])
    graphed, plain = _both(ensemble, _sources(3), DecodeOptions(max_len_a=1.0, max_len_b=3))
    assert graphed[1].tolist() == plain[1].tolist()
    for row, n, reference in zip(graphed[0].tolist(), graphed[1].tolist(), plain[0].tolist()):
        assert row[:n] == reference[:n]
    torch.testing.assert_close(graphed[2], plain[2], rtol=1e-9, atol=1e-9)


def _likely_specials(model):
    """The model with padding and the start symbol made likelier than most tokens."""
    with torch.no_grad():
        model.output_proj.weight[PAD_ID:BOS_ID + 1] *= 8
    return model


def test_the_static_step_never_writes_padding_or_the_start_symbol_as_the_plain_loop():
    src = _sources()
    (out, lengths, scores), plain = _both(_likely_specials(_model(1)), src, DecodeOptions(max_len_a=1.0, max_len_b=6))
    assert lengths.tolist() == plain[1].tolist()
    rows = [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]
    assert rows == [row[:n] for row, n in zip(plain[0].tolist(), lengths.tolist())]
    assert not {PAD_ID, BOS_ID} & {t for row in rows for t in row}
    torch.testing.assert_close(scores, plain[2], rtol=1e-9, atol=1e-9)


def _beams(model, src, options):
    """The static beam step run eagerly, and ``beam_search``'s plain loop: (tokens, score, normalised)
    of each sentence's best hypothesis."""
    models = as_ensemble(model)
    limits = max_new_tokens(src, models.pad_id, options, models.max_len)
    with torch.no_grad():
        tokens, lengths, scores, normalized = graphs.beam(models, models.encode(src), limits,
                                                          options.beam_size, options.length_penalty,
                                                          options.min_len, capture=False)
    graphed = [(row[:n], s, z) for row, n, s, z in zip(tokens.tolist(), lengths.tolist(), scores.tolist(),
                                                       normalized.tolist())]
    plain = [(h.tokens, h.score, h.normalized) for [h] in beam_search(model, src, options)]
    return graphed, plain


@pytest.mark.parametrize("overrides, beams, alpha, min_len", [
    ({}, 4, 0.6, 0),
    ({}, 2, 0.0, 3),
    ({"norm": "pre", "activation": "gelu"}, 4, 0.6, 1),
    ({}, 5, 1.0, 2),
    ({"positional": "learned", "attention_bias": True}, 3, 0.6, 2),
    ({"positional": "rope"}, 4, 0.6, 0),
    ({"positional": "alibi"}, 3, 1.0, 1),
])
def test_the_static_beam_step_finds_beam_searchs_best_hypotheses(overrides, beams, alpha, min_len):
    model, lengths = _model(4, **overrides), set()  # a seed whose beams end at many lengths
    for max_len_b in (2, 4, 9):  # limits that end sentences, and room for EOS to end them
        options = DecodeOptions(beam_size=beams, length_penalty=alpha, min_len=min_len, max_len_a=1.0,
                                max_len_b=max_len_b)
        graphed, plain = _beams(model, _sources(), options)
        for (tokens, score, normalized), (tokens_plain, score_plain, normalized_plain) in zip(graphed, plain):
            assert tokens == tokens_plain
            assert score == pytest.approx(score_plain, rel=1e-9, abs=1e-9)
            assert normalized == pytest.approx(normalized_plain, rel=1e-9, abs=1e-9)
        lengths |= {len(t) for t, _, _ in graphed}
    assert len(lengths) > 2  # hypotheses of several lengths


def test_the_static_beam_step_never_writes_padding_or_the_start_symbol_as_the_plain_loop():
    options = DecodeOptions(beam_size=3, max_len_a=1.0, max_len_b=6)
    graphed, plain = _beams(_likely_specials(_model(1)), _sources(), options)
    assert [tokens for tokens, _, _ in graphed] == [tokens for tokens, _, _ in plain]
    assert not {PAD_ID, BOS_ID} & {t for tokens, _, _ in graphed for t in tokens}
    assert [score for _, score, _ in graphed] == pytest.approx([score for _, score, _ in plain], rel=1e-9, abs=1e-9)


def test_the_static_beam_step_of_an_ensemble_finds_beam_searchs_best_hypotheses():
    graphed, plain = _beams(Ensemble([_model(1), _model(2)]), _sources(3), DecodeOptions(beam_size=4, max_len_a=1.0,
                                                                                          max_len_b=5))
    assert [t for t, _, _ in graphed] == [t for t, _, _ in plain]
    assert [s for _, s, _ in graphed] == pytest.approx([s for _, s, _ in plain], rel=1e-9, abs=1e-9)


def test_graphs_apply_only_to_plain_searches_on_a_gpu(monkeypatch):
    model, src = _model(1), _sources()
    monkeypatch.setattr(graphs, "_enabled", True)
    on_gpu = torch.empty(0, device="meta")  # stands for a CUDA tensor: only ``is_cuda`` is read
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type in ("cuda", "meta")))
    greedy, beams = DecodeOptions(), DecodeOptions(beam_size=4)
    assert graphs.applies(Ensemble([model]), on_gpu, greedy) and graphs.applies(Ensemble([model]), on_gpu, beams)
    assert not graphs.applies(Ensemble([model]), src, greedy)  # a CPU tensor
    assert not graphs.applies(Ensemble([model]), on_gpu, DecodeOptions(sample=True))
    # a prefix, an n-gram ban, an alignment or an n-best list
    assert not graphs.applies(Ensemble([model]), on_gpu, greedy, prefix=src)
    for plain_only in (DecodeOptions(no_repeat_ngram=3), DecodeOptions(align_layer=0),
                       DecodeOptions(beam_size=4, nbest=2)):
        assert not graphs.applies(Ensemble([model]), on_gpu, plain_only)
    for positional in ("learned", "rope", "alibi"):  # every kind of positions steps at a tensor-held position
        assert graphs.applies(Ensemble([model, _model(1, positional=positional)]), on_gpu, beams)
    assert not graphs.applies(Ensemble([model.train()]), on_gpu, greedy)
    monkeypatch.setattr(graphs, "_enabled", False)
    assert not graphs.applies(Ensemble([model.eval()]), on_gpu, greedy)


def test_greedy_decoding_on_a_cpu_takes_the_plain_loop(monkeypatch):
    monkeypatch.setattr(graphs, "_enabled", True)
    monkeypatch.setattr(graphs, "greedy", lambda *args, **kwargs: pytest.fail("graphs on a CPU"))
    hypotheses = greedy_or_sample(_model(1), _sources(), DecodeOptions(max_len_a=0, max_len_b=5))
    assert len(hypotheses) == 6


def test_a_step_that_cannot_be_recorded_warns_once_and_decodes_on_the_plain_path(monkeypatch):
    model, src = _model(1), _sources()
    options = DecodeOptions(max_len_a=1.0, max_len_b=4)
    expected = [h.tokens for h in greedy_or_sample(model, src, options)]

    def unrecordable(step):
        step()  # the eager first step has run when recording fails
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", unrecordable)
    monkeypatch.setattr(graphs, "_enabled", True)
    monkeypatch.setattr(graphs, "applies", lambda *args: graphs._enabled)  # as on a GPU
    with pytest.warns(UserWarning, match="could not be recorded as a CUDA graph.*a step at a time"):
        assert [h.tokens for h in greedy_or_sample(model, src, options)] == expected
    assert not graphs._enabled  # the piece is off from then on: no second warning
    assert [h.tokens for h in greedy_or_sample(model, src, options)] == expected


@pytest.mark.parametrize("beams", [1, 4])
def test_a_recorded_step_reads_nothing_back_from_the_device(beams):
    """A CUDA graph cannot record an op that waits for the device's values (``.item()``, ``nonzero``, a
    boolean mask): recording would fail and decoding fall back to a step at a time. Checked on the CPU
    with the ops that a step runs, min_len and an ensemble included."""
    from conftest import HostReads

    model = _model(1)
    models = as_ensemble(Ensemble([model, model]))
    src = _sources()
    limits = max_new_tokens(src, models.pad_id, DecodeOptions(max_len_a=1.0, max_len_b=4), models.max_len)
    state = graphs.GreedyState(limits) if beams == 1 else graphs.BeamState(limits, beams, 0.6)
    rows, L = limits.shape[0] * beams, int(limits.max())
    with torch.inference_mode():
        decoders = graphs.Decoders(models, models.encode(src), rows, L)
        state.step(decoders, 2)  # the first, eager step makes the caches
        with HostReads() as reads:
            state.step(decoders, 2)
            state.step(decoders, 2)
    assert reads.seen == []
    with HostReads() as reads:  # the recorder sees such a read
        bool(state.over())
    assert reads.seen == ["_local_scalar_dense"]
