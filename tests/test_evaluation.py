import pytest

from tformer_cli.evaluation import corpus_scores

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
