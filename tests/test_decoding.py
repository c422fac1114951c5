import pytest
import torch

from conftest import tiny_model_config
from tformer_cli.accel.search import argmax, topk
from tformer_cli.decoding import DecodeOptions, beam_search, decode_batch, greedy_or_sample, translate
from tformer_cli.model import build_model
from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, Vocabulary

VOCAB = 24


@pytest.fixture
def model():
    model = build_model(tiny_model_config(), VOCAB).eval()
    with torch.no_grad():  # make EOS reasonably likely so that sentences finish at different steps
        model.output_proj.weight[EOS_ID] *= 3
    return model


def _sources():
    src = torch.randint(4, VOCAB, (5, 7))
    src[:, -1] = EOS_ID
    src[1, 3:] = 0
    src[3, 5:] = 0
    return src


def _uncached_greedy(model, src, steps):
    """Reference: recompute the whole prefix at every step, no cache, no pruning."""
    ys = torch.full((src.shape[0], 1), BOS_ID)
    for _ in range(steps):
        logits = model(src, ys)[:, -1]
        ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:]


def _trim(row):
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


def test_cached_greedy_with_pruning_equals_uncached_recomputation(model):
    src = _sources()
    options = DecodeOptions(max_len_a=0, max_len_b=12)
    ours = greedy_or_sample(model, src, options)
    reference = _uncached_greedy(model, src, 12).tolist()
    assert [h.tokens for h in ours] == [_trim(r) for r in reference]
    assert len({len(h.tokens) for h in ours}) > 1  # sentences finished at different steps
    with torch.no_grad():  # scores are the model's log-probabilities of the output (EOS included)
        for row, hyp in zip(src, ours):
            target = hyp.tokens + ([EOS_ID] if len(hyp.tokens) < 12 else [])
            tgt = torch.tensor([[BOS_ID] + target])
            log_probs = model(row[None], tgt[:, :-1]).log_softmax(-1)
            expected = log_probs[0, torch.arange(len(target)), torch.tensor(target)].sum().item()
            assert hyp.score == pytest.approx(expected, abs=1e-4)


def test_beam_of_one_equals_greedy(model):
    src = _sources()
    greedy = greedy_or_sample(model, src, DecodeOptions(max_len_a=0, max_len_b=10))
    beam = beam_search(model, src, DecodeOptions(beam_size=1, length_penalty=0.0, max_len_a=0, max_len_b=10))
    assert [b[0].tokens for b in beam] == [g.tokens for g in greedy]


def _uncached_beam(model, src_row, options, limit):
    """Reference: one sentence, K beams each recomputed from scratch at every step, in plain Python:
    the 2K best expansions, those ending in EOS among the first K finish, the K best others go on, up
    to the length limit, where the live beams end too. It never stops early: finished hypotheses do not
    change the live beams, so an early stop must not change which nbest come out."""
    K, alpha = options.beam_size, options.length_penalty
    penalty = lambda length: ((5 + length) / 6) ** alpha  # noqa: E731
    beams, finished = [([], 0.0)], []  # (tokens, score)
    for t in range(limit):
        expansions = []
        for tokens, score in beams:
            tgt = torch.tensor([[BOS_ID] + tokens])
            log_probs = model(src_row[None], tgt)[0, -1].log_softmax(-1).tolist()
            expansions += [(score + lp, tokens, token) for token, lp in enumerate(log_probs)
                           if token not in (PAD_ID, BOS_ID)]  # never outputs
        expansions.sort(key=lambda e: -e[0])
        best = expansions[:2 * K]
        finished += [(tokens, score, score / penalty(t + 1)) for score, tokens, token in best[:K] if token == EOS_ID]
        beams = [(tokens + [token], score) for score, tokens, token in best if token != EOS_ID][:K]
        if t + 1 >= limit:  # the live beams end too, and compete
            finished += [(tokens, score, score / penalty(t + 1)) for tokens, score in beams]
            break
    return sorted(finished, key=lambda f: -f[2])[:options.nbest]


@pytest.mark.parametrize("alpha,nbest,eos", [(0.0, 1, 1.5), (0.6, 3, 1.5), (1.0, 2, 2.0), (0.6, 3, 2.0)])
def test_batched_beam_search_equals_a_reference_beam_per_sentence(alpha, nbest, eos):
    model = build_model(tiny_model_config(), VOCAB).eval()
    with torch.no_grad():  # hypotheses end by EOS at many lengths, and some at the length limit
        model.output_proj.weight[EOS_ID] *= eos
    src = _sources()
    options = DecodeOptions(beam_size=4, nbest=nbest, length_penalty=alpha, max_len_a=0, max_len_b=9)
    ours = beam_search(model, src, options)
    with torch.no_grad():
        for row, hyps in zip(src, ours):
            row = row[row != 0]  # unpadded: the reference sees the sentence alone
            reference = _uncached_beam(model, row, options, 9)
            assert [h.tokens for h in hyps] == [f[0] for f in reference]
            assert [h.score for h in hyps] == pytest.approx([f[1] for f in reference], abs=1e-4)
            assert [h.normalized for h in hyps] == pytest.approx([f[2] for f in reference], abs=1e-4)


@pytest.mark.parametrize("seed, alpha", [(1, 0.0), (1, 0.6), (2, 1.0), (15, 0.6)])
def test_stopping_a_sentence_early_never_changes_its_nbest_hypotheses(seed, alpha, monkeypatch):
    """Finished hypotheses do not steer the live beams, so a search run to every sentence's length limit
    finds what an early stop must keep: the nbest best, not only the best (these seeds' sentences had
    a live beam that would beat the third hypothesis once the first could no longer be beaten)."""
    from tformer_cli import decoding

    torch.manual_seed(seed)
    model = build_model(tiny_model_config(), VOCAB).eval()
    with torch.no_grad():
        model.output_proj.weight[EOS_ID] *= 3
    src = torch.randint(4, VOCAB, (6, 7), generator=torch.Generator().manual_seed(seed))
    src[:, -1] = EOS_ID
    options = DecodeOptions(beam_size=4, nbest=3, length_penalty=alpha, max_len_a=0, max_len_b=12)
    early = beam_search(model, src, options)
    done = decoding._sentences_done

    def at_the_limit_only(finished, alive, live_scores, length, limits, options):
        return [length >= limits[s] for s in alive], done(finished, alive, live_scores, length, limits, options)[1]

    monkeypatch.setattr(decoding, "_sentences_done", at_the_limit_only)
    full = beam_search(model, src, options)
    assert [[h.tokens for h in hyps] for hyps in early] == [[h.tokens for h in hyps] for hyps in full]


def test_at_the_length_limit_a_live_beam_beats_a_worse_finished_hypothesis(model):
    """With room for one token, beam search's best is greedy's: the likeliest first token, EOS or not,
    also where EOS is among the K best but a word is better (a sentence cut at its limit competes with
    the hypotheses that finished, as in Hugging Face's generate)."""
    src = torch.randint(4, VOCAB, (32, 7))
    src[:, -1] = EOS_ID
    with torch.no_grad():
        first = model(src, torch.full((32, 1), BOS_ID))[:, 0]
        first[:, PAD_ID:BOS_ID + 1] = float("-inf")  # never outputs
    ranks = (first > first[:, EOS_ID:EOS_ID + 1]).sum(dim=-1)  # tokens likelier than EOS
    assert ((ranks > 0) & (ranks < 4)).any()  # EOS finishes a hypothesis, but a word is likelier
    greedy = greedy_or_sample(model, src, DecodeOptions(max_len_a=0, max_len_b=1))
    beam = beam_search(model, src, DecodeOptions(beam_size=4, length_penalty=0.6, max_len_a=0, max_len_b=1))
    assert [b[0].tokens for b in beam] == [g.tokens for g in greedy]
    assert [b[0].tokens for b in beam] == [[] if t == EOS_ID else [t] for t in first.argmax(dim=-1).tolist()]


def test_beam_search_scores_at_least_as_well_as_greedy(model):
    src = _sources()
    options = dict(length_penalty=0.0, max_len_a=0, max_len_b=10)
    greedy = greedy_or_sample(model, src, DecodeOptions(**options))
    beams = beam_search(model, src, DecodeOptions(beam_size=4, nbest=3, **options))
    for g, hyps in zip(greedy, beams):
        assert hyps[0].score >= g.score - 1e-5
        assert len(hyps) == 3 and [h.normalized for h in hyps] == sorted((h.normalized for h in hyps), reverse=True)


def test_low_temperature_and_top_k_one_sampling_equal_greedy(model):
    src = _sources()
    greedy = [h.tokens for h in greedy_or_sample(model, src, DecodeOptions(max_len_a=0, max_len_b=10))]
    for options in (DecodeOptions(sample=True, temperature=0.0), DecodeOptions(sample=True, temperature=1e-4),
                    DecodeOptions(sample=True, temperature=1e-300),  # log-probabilities / T overflow to -inf
                    DecodeOptions(sample=True, top_k=1, seed=3), DecodeOptions(sample=True, top_p=1e-6, seed=3),
                    DecodeOptions(sample=True, top_p=1e-300, seed=3)):  # p is 0 in float32: the likeliest stays
        options.max_len_a, options.max_len_b = 0, 10
        assert [h.tokens for h in greedy_or_sample(model, src, options)] == greedy


def test_a_temperature_past_the_logits_range_samples_uniformly_over_the_tokens_allowed():
    from tformer_cli.decoding import _sample

    log_probs = torch.randn(6, 50).log_softmax(-1)
    log_probs[:, :3] = float("-inf")  # banned, as padding and the start symbol are
    uniform = torch.zeros(6, 50).masked_fill(log_probs == float("-inf"), float("-inf")).softmax(-1)
    for temperature in (1e39, 1e300):  # inf in float32: (log-probabilities - best) / T were nan where banned
        options = DecodeOptions(sample=True, temperature=temperature)
        drawn = _sample(log_probs, options, torch.Generator().manual_seed(5))
        assert torch.equal(drawn, torch.multinomial(uniform, 1, generator=torch.Generator().manual_seed(5)).squeeze(1))
        assert (drawn >= 3).all()


def test_seeds_reproduce_samples(model):
    src = _sources()

    def draw(seed):
        options = DecodeOptions(sample=True, temperature=1.5, top_p=0.95, seed=seed, max_len_a=0, max_len_b=10)
        return [h.tokens for h in greedy_or_sample(model, src, options)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_min_len_forces_exactly_n_tokens(model):
    src = _sources()
    for hyps in decode_batch(model, src, DecodeOptions(beam_size=3, min_len=9, max_len_a=0, max_len_b=9)):
        assert len(hyps[0].tokens) == 9 and EOS_ID not in hyps[0].tokens
    for hyp in greedy_or_sample(model, src, DecodeOptions(min_len=9, max_len_a=0, max_len_b=9)):
        assert len(hyp.tokens) == 9


def test_translate_keeps_input_order_and_handles_empty_and_long_inputs(model):
    vocab = Vocabulary.train([("a b c d e f", "a b c d e f")] * 3, vocab_size=VOCAB, min_frequency=1)
    texts = ["a b", "", "a b c d e f " * 30, "c", "   "]
    options = DecodeOptions(max_len_a=0, max_len_b=5)
    results = translate(model, vocab, texts, options, batch_size=2)
    assert [r.source for r in results] == texts
    assert results[1].outputs[0][0] == "" and results[4].outputs[0][0] == ""
    assert results[2].truncated and not results[0].truncated
    alone = translate(model, vocab, ["c"], options)[0]
    assert alone.outputs[0][1].tokens == results[3].outputs[0][1].tokens


@pytest.mark.parametrize("options, sentences", [(DecodeOptions(), 256), (DecodeOptions(beam_size=4), 64),
                                                 (DecodeOptions(beam_size=300), 1),
                                                 (DecodeOptions(sample=True, nbest=3), 85)])
def test_by_default_a_batch_holds_256_hypotheses(model, monkeypatch, options, sentences):
    import tformer_cli.decoding as decoding
    from tformer_cli.batching import sentences_per_batch

    batches = []
    monkeypatch.setattr(decoding, "decode_batch", lambda model, src, options, prefix: batches.append(src.shape[0])
                        or [[decoding.Hypothesis([], 0.0, 0.0)]] * src.shape[0])
    vocab = Vocabulary.train([("a b c", "a b c")], vocab_size=VOCAB, min_frequency=1)
    translate(model, vocab, ["a b"] * 300, options)
    assert batches[0] == sentences and sum(batches) == 300
    assert sentences_per_batch(options) == sentences


@pytest.mark.parametrize("options", [DecodeOptions(), DecodeOptions(beam_size=4),
                                     DecodeOptions(sample=True, nbest=3)])
@pytest.mark.parametrize("batch_size, max_tokens", [(None, 200), (5, 200), (None, 7), (3, None), (None, None)])
def test_decoding_batches_are_the_longest_runs_within_both_limits(options, batch_size, max_tokens):
    from tformer_cli.batching import decoding_batches, hypotheses_per_sentence

    lengths = sorted(torch.randint(2, 40, (300,), generator=torch.Generator().manual_seed(0)).tolist())
    batches = decoding_batches(lengths, options, batch_size, max_tokens)
    width = hypotheses_per_sentence(options)
    cap = batch_size or (len(lengths) if max_tokens else 256 // width)

    def fits(start, end):  # sentences start..end-1 in one batch
        tokens = (end - start) * width * lengths[end - 1]
        return end - start <= cap and (max_tokens is None or tokens <= max_tokens or end - start == 1)

    assert [i for batch in batches for i in batch] == list(range(len(lengths)))  # in order, each once
    for batch in batches:
        assert fits(batch.start, batch.stop)
        assert batch.stop == len(lengths) or not fits(batch.start, batch.stop + 1)  # nothing more fits


def test_a_token_budget_changes_the_batches_not_the_translations(model, monkeypatch):
    import tformer_cli.decoding as decoding

    vocab = Vocabulary.train([("a b c d e f", "a b c d e f")] * 3, vocab_size=VOCAB, min_frequency=1)
    texts = [" ".join("abcdef"[(i * j) % 6] for j in range(1 + i % 9)) for i in range(40)]
    options = DecodeOptions(beam_size=3, max_len_a=0, max_len_b=6)
    shapes, decode = [], decoding.decode_batch
    monkeypatch.setattr(decoding, "decode_batch", lambda *a: shapes.append(tuple(a[1].shape)) or decode(*a))
    budgeted = translate(model, vocab, texts, options, max_tokens=60)
    assert len(shapes) > 3 and all(rows * 3 * length <= 60 or rows == 1 for rows, length in shapes)
    alone = translate(model, vocab, texts, options, batch_size=1)
    for a, b in zip(budgeted, alone):
        assert a.outputs[0][0] == b.outputs[0][0]
        assert a.outputs[0][1].score == pytest.approx(b.outputs[0][1].score, abs=1e-4)


def test_sampling_nbest_draws_several_samples_per_source(model):
    src = _sources()
    options = DecodeOptions(sample=True, temperature=2.0, seed=5, nbest=4, max_len_a=0, max_len_b=8)
    groups = decode_batch(model, src, options)
    assert len(groups) == 5 and all(len(g) == 4 for g in groups)
    assert all([h.score for h in g] == sorted((h.score for h in g), reverse=True) for g in groups)
    assert any(len({tuple(h.tokens) for h in g}) > 1 for g in groups)


def test_reordering_within_beams_equals_a_full_select(model):
    src = _sources()[:2].repeat_interleave(3, dim=0)  # 2 sentences x 3 beams
    tgt = torch.randint(4, VOCAB, (6, 4))
    encoded = model.encode(src)
    full, partial = model.start_cache(encoded), model.start_cache(encoded)
    with torch.no_grad():
        for cache in (full, partial):
            model.decode(tgt, encoded, cache)
        index = torch.tensor([2, 2, 0, 4, 3, 3])  # rows stay within their sentence's block
        full.select(index)
        partial.reorder(index)
        step = torch.randint(4, VOCAB, (6, 1))
        a = model.decode(step, encoded, full).hidden
        b = model.decode(step, encoded, partial).hidden
    torch.testing.assert_close(a, b)


def test_beams_sharing_their_sentences_memory_equal_a_memory_row_per_beam(model):
    from tformer_cli.model.transformer import Encoded

    K, src = 3, _sources()  # 5 sentences x 3 beams; sentences 1 and 3 are padded
    encoded = model.encode(src)
    repeated = Encoded(encoded.memory.repeat_interleave(K, dim=0), encoded.mask.repeat_interleave(K, dim=0))
    grouped, flat = model.start_cache(encoded, group=K), model.start_cache(repeated)
    with torch.no_grad():
        tgt = torch.randint(4, VOCAB, (5 * K, 3))
        torch.testing.assert_close(model.decode(tgt, encoded, grouped).hidden, model.decode(tgt, repeated, flat).hidden)
        rows = torch.tensor([k + K * s for s in (0, 3, 4) for k in range(K)])  # sentences 1 and 2 finished
        grouped.select(rows)
        flat.select(rows)
        step = torch.randint(4, VOCAB, (rows.numel(), 1))
        a = model.decode(step, encoded, grouped, need_weights=True)
        b = model.decode(step, repeated, flat, need_weights=True)
        torch.testing.assert_close(a.hidden, b.hidden)
        for wa, wb in zip(a.cross_attention, b.cross_attention):
            assert wa.shape == wb.shape == (rows.numel(), 4, 1, src.shape[1])
            torch.testing.assert_close(wa, wb)


@pytest.mark.parametrize("vocab", [8000, 37000, 24, 100, 7])
def test_blocked_argmax_equals_torch_argmax_with_ties(vocab):
    torch.manual_seed(0)
    x = torch.randint(0, 5, (64, vocab)).float()  # many ties: the first maximum must win
    x[3] = 0.0
    x[5, -1] = 9.0  # the maximum in the last column
    x[6, 0] = 9.0  # and in the first
    assert torch.equal(argmax(x), x.argmax(-1))
    y = torch.randn(16, vocab)
    assert torch.equal(argmax(y), y.argmax(-1))


@pytest.mark.parametrize("columns, k", [(4 * 8000, 8), (4 * 37000, 8), (2 * 24, 4), (700, 10), (96, 8)])
def test_blocked_topk_equals_torch_topk(columns, k):
    torch.manual_seed(0)
    x = torch.randn(16, columns)
    x[2, -1], x[3, 0] = 50.0, 50.0  # the largest in the last column, and in the first
    x[4, : columns // 2] = float("-inf")  # beams not yet expanded score -inf
    x[5, columns - k:] = 10.0 + torch.arange(k)  # all k largest in the last block
    values, indices = topk(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(indices, expected.indices)


def test_a_model_held_in_bf16_decodes_as_the_fp32_model_does(model):
    """``--precision bf16`` on a GPU holds the model in bf16 (cli_options.hold_for_decoding): the cache,
    positions and scores then run in bf16 too."""
    import copy
    from contextlib import nullcontext

    from tformer_cli.cli_options import hold_for_decoding
    from tformer_cli.ensemble import Ensemble

    with torch.no_grad():  # peaked distributions: bf16 rounding must not flip an argmax
        model.output_proj.weight *= 8
    held = Ensemble([copy.deepcopy(model)])
    amp = object()
    assert hold_for_decoding(held, torch.device("cpu"), "bf16", amp) is amp  # CPUs: autocast, the model as it was
    assert hold_for_decoding(held, torch.device("cuda"), "fp16", amp) is amp
    assert hold_for_decoding(held, torch.device("cuda"), "bf16", amp, accel="off") is amp  # the plain path
    assert held.models[0].output_proj.weight.dtype == torch.float32
    assert isinstance(hold_for_decoding(held, torch.device("cuda"), "bf16", amp), nullcontext)
    assert all(p.dtype == torch.bfloat16 for p in held.models[0].parameters())
    src = _sources()
    for options in (DecodeOptions(max_len_a=0, max_len_b=10), DecodeOptions(beam_size=3, max_len_a=0, max_len_b=10)):
        assert [h[0].tokens for h in decode_batch(held, src, options)] == \
            [h[0].tokens for h in decode_batch(model, src, options)]
