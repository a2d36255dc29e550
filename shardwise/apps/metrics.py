"""Scores for generated answers: exact match, BLEU-4 and ROUGE-L, averaged over samples (x100).

Text is split into units before scoring: every CJK character (and full-width punctuation) is a
unit of its own, runs of letters/digits form a word, other punctuation marks are single units,
whitespace only separates. So Chinese is scored per character and English per word.

* exact match: prediction == reference after stripping surrounding whitespace.
* BLEU-4: sentence BLEU with uniform weights over 1..4-grams, brevity penalty, and NIST
  geometric smoothing for n-gram orders without a match (nltk's ``SmoothingFunction().method3``);
  0 when no unit matches.
* ROUGE-L: F1 of the longest common subsequence (precision over the prediction's length,
  recall over the reference's).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

__all__ = ["bleu4", "rouge_l", "score", "units"]


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2FA1F
            or 0xF900 <= cp <= 0xFAFF or 0x3000 <= cp <= 0x303F or 0xFF00 <= cp <= 0xFFEF)


def units(text: str) -> list[str]:
    out: list[str] = []
    word = ""
    for ch in text:
        if ch.isalnum() and not _is_cjk(ch):
            word += ch
            continue
        if word:
            out.append(word)
            word = ""
        if not ch.isspace():
            out.append(ch)
    if word:
        out.append(word)
    return out


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu4(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """Sentence BLEU-4 in [0, 1] of unit lists."""
    if not prediction or not reference:
        return 0.0
    log_sum, k = 0.0, 1
    for n in range(1, 5):
        pred = _ngrams(prediction, n)
        total = sum(pred.values())
        if total == 0:  # prediction shorter than n: NIST smoothing on an empty order
            k *= 2
            log_sum += math.log(1.0 / k)
            continue
        matches = sum(min(c, _ngrams(reference, n)[g]) for g, c in pred.items())
        if matches == 0 and n == 1:  # nothing in common at all
            return 0.0
        if matches == 0:
            k *= 2
            log_sum += math.log(1.0 / (k * total))
        else:
            log_sum += math.log(matches / total)
    c, r = len(prediction), len(reference)
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return brevity * math.exp(log_sum / 4)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """ROUGE-L F1 in [0, 1] of unit lists."""
    if not prediction or not reference:
        return 0.0
    lcs = _lcs(prediction, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(prediction), lcs / len(reference)
    return 2 * p * r / (p + r)


def score(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """``{"exact_match", "bleu-4", "rouge-l", "samples"}``; the scores are percentages."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    n = len(predictions)
    if n == 0:
        return {"exact_match": 0.0, "bleu-4": 0.0, "rouge-l": 0.0, "samples": 0}
    em = bl = rl = 0.0
    for pred, ref in zip(predictions, references):
        em += pred.strip() == ref.strip()
        pu, ru = units(pred), units(ref)
        bl += bleu4(pu, ru)
        rl += rouge_l(pu, ru)
    return {"exact_match": 100 * em / n, "bleu-4": 100 * bl / n, "rouge-l": 100 * rl / n, "samples": n}
