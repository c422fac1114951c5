import math

import pytest
import torch
import torch.nn.functional as F

from conftest import HostReads, tiny_batch, tiny_model_config
from tformer_cli.encoding import EncodedSplit
from tformer_cli.evaluation import corpus_scores, evaluate_loss, label_smoothed_loss
from tformer_cli.model import build_model

REFS = ["ein Mann fährt Fahrrad .", "zwei Hunde spielen im Schnee", "einundzwanzig"]


def test_bleu_of_a_perfect_hypothesis_file_is_100_and_of_an_empty_one_0():
    perfect = corpus_scores(REFS, REFS)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    assert perfect["exact_match"] == 100.0
    empty = corpus_scores(["", "", ""], REFS)
    assert empty["bleu"] == 0.0 and empty["exact_match"] == 0.0
    assert perfect["bleu_signature"].startswith("nrefs:1|case:mixed")


def test_lowercased_bleu_ignores_case():
    upper = [r.upper() for r in REFS]
    scores = corpus_scores(upper, REFS)
    assert scores["bleu_lowercase"] == pytest.approx(100.0) and scores["bleu"] < 50
    assert 0 < corpus_scores(["ein Mann fährt Auto .", "", ""], REFS)["bleu"] < 100


def test_label_smoothed_loss_equals_torch_cross_entropy():
    model = build_model(tiny_model_config(), 40).eval()
    batch = tiny_batch()
    loss, nll = label_smoothed_loss(model, batch, 0.1)
    logits = model(batch.src, batch.tgt_in)
    expected = F.cross_entropy(logits.transpose(1, 2), batch.tgt_out, ignore_index=0, label_smoothing=0.1,
                               reduction="sum")
    expected_nll = F.cross_entropy(logits.transpose(1, 2), batch.tgt_out, ignore_index=0, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nll, expected_nll, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rdrop", [0.0, 0.5])
def test_the_training_loss_reads_nothing_back_from_the_device(rdrop):
    """Forward and backward select the real target tokens by positions found on the host: no op that
    waits for a GPU (boolean-mask indexing did, three times a step)."""
    model = build_model(tiny_model_config(dropout=0.1), 40).train()
    batch = tiny_batch()
    with HostReads() as reads:
        loss, _ = label_smoothed_loss(model, batch, 0.1, rdrop)
        loss.backward()
    assert reads.seen == []
    with HostReads() as reads:  # the recorder sees such reads
        torch.randn(batch.tgt_out.shape)[batch.tgt_out != 0].sum().item()
    assert reads.seen == ["index", "_local_scalar_dense"]


def test_rdrop_loss_runs_the_batch_twice_under_different_dropout_masks():
    model = build_model(tiny_model_config(dropout=0.3), 40).train()
    batch = tiny_batch()
    torch.manual_seed(1)
    loss, nll = label_smoothed_loss(model, batch, 0.1, rdrop=2.0)
    torch.manual_seed(1)  # the same masks: one forward over the batch stacked on itself
    logits = model(torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in]))
    real = batch.tgt_out != 0
    first, second = logits[:3][real], logits[3:][real]
    assert not torch.allclose(first, second)  # the passes differ only by their dropout masks
    log_p, log_q = F.log_softmax(first, dim=-1), F.log_softmax(second, dim=-1)
    kl = (F.kl_div(log_p, log_q, log_target=True, reduction="sum")
          + F.kl_div(log_q, log_p, log_target=True, reduction="sum")) / 2
    ce = sum(F.cross_entropy(x, batch.tgt_out[real], label_smoothing=0.1, reduction="sum") for x in (first, second))
    torch.testing.assert_close(loss, ce / 2 + 2.0 * kl, rtol=1e-5, atol=1e-4)
    nll_mean = sum(F.cross_entropy(x, batch.tgt_out[real], reduction="sum") for x in (first, second)) / 2
    torch.testing.assert_close(nll, nll_mean, rtol=1e-5, atol=1e-4)


def test_evaluate_loss_of_a_uniform_model_is_log_v_per_real_target_token():
    """A zero output projection makes every next-token distribution uniform over the V target ids, so
    the mean NLL is log V and the perplexity V, whatever the inputs; padding is not counted."""
    model = build_model(tiny_model_config(), 40)
    with torch.no_grad():
        model.output_proj.weight.zero_()
    split = EncodedSplit([[5, 6, 2], [7, 2], [8, 9, 10, 11, 2]], [[1, 5, 2], [1, 6, 7, 8, 2], [1, 2]],
                         [("a", "b"), ("c", "d"), ("e", "f")])
    result = evaluate_loss(model, split, max_tokens=8)  # several batches of padded rows
    assert result.tokens == 2 + 4 + 1  # the target tokens after <s>, </s> included
    assert result.loss == pytest.approx(math.log(40), rel=1e-6)
    assert result.perplexity == pytest.approx(40, rel=1e-5)
    assert model.training  # the model's mode is restored


def test_evaluate_run_against_figures_worked_out_by_hand(tmp_path):
    """A model whose every output distribution is the same: logit c for </s>, 0 for the other V - 1
    ids. Decoding then stops at once (empty hypotheses: BLEU, chrF and exact match 0), and the loss
    follows from counting: each sentence's one </s> costs -log p_eos, every other token -log p_other."""
    import json

    from tformer_cli.config import DataConfig
    from tformer_cli.decoding import DecodeOptions
    from tformer_cli.evaluation import evaluate_run
    from tformer_cli.tokenizer import EOS_ID, Vocabulary

    pairs = [("one", "eins"), ("two three", "zwei drei"), ("four", "vier fünf sechs")]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"en": s, "de": t}) + "\n" for s, t in pairs))
    vocab = Vocabulary.train(pairs * 5, vocab_size=60, min_frequency=1)
    V, c = vocab.tgt_size, 3.0
    model = build_model(tiny_model_config(norm="pre"), vocab.src_size, V).eval()
    with torch.no_grad():  # the decoder's final LayerNorm outputs the constant e_0; W maps it to the logits
        model.decoder.final_norm.weight.zero_()
        model.decoder.final_norm.bias.zero_()
        model.decoder.final_norm.bias[0] = 1.0
        model.output_proj.weight.zero_()
        model.output_proj.weight[EOS_ID, 0] = c
    cfg = DataConfig(data_files={"test": str(tmp_path / "test.jsonl")}, source="en", target="de", max_length=64)
    result = evaluate_run(model, vocab, cfg, "test", DecodeOptions(beam_size=1), None, 1000)

    tokens = sum(len(ids) - 1 for ids in vocab.encode_targets([t for _, t in pairs]))  # after <s>, </s> included
    log_z = math.log(math.exp(c) + V - 1)
    expected = (len(pairs) * (log_z - c) + (tokens - len(pairs)) * log_z) / tokens
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert result["hypotheses"] == ["", "", ""] and result["sentences"] == 3
    assert (result["bleu"], result["chrf"], result["exact_match"]) == (0.0, 0.0, 0.0)
