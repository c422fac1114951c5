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
    """Each candidate's mean utility against all candidates as pseudo-references. Identical candidates
    are scored once and weighted by their count, so a peaked model's repeated samples cost nothing."""
    counts = Counter(candidates)
    utility = {hypothesis: sum(count * metric.sentence_score(hypothesis, [reference]).score
                               for reference, count in counts.items()) / len(candidates)
               for hypothesis in counts}
    return [utility[c] for c in candidates]


def rank(candidates: list[str], metric) -> tuple[list[int], list[float]]:
    """Candidate indices by expected utility, highest first (ties keep the search's order), and the
    utilities in that order."""
    utilities = expected_utilities(candidates, metric)
    order = sorted(range(len(candidates)), key=lambda i: -utilities[i])
    return order, [utilities[i] for i in order]
