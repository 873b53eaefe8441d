"""Answer scoring for search QA, as pure functions.

`normalize_answer` is SQuAD's (lowercase, drop punctuation and the articles a/an/the, squeeze spaces), the
normalization Search-R1's exact-match reward and most open-domain QA papers use, so EM numbers compare.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lowercase, punctuation and the articles a/an/the dropped, whitespace squeezed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1 if the normalized prediction equals any normalized gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best SQuAD token F1 of the prediction against any gold answer."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def is_supported(answer: str, evidence: Sequence[str]) -> bool:
    """Whether the normalized answer occurs, on word boundaries, in some normalized evidence text."""
    needle = normalize_answer(answer)
    return bool(needle) and any(f" {needle} " in f" {normalize_answer(text)} " for text in evidence)
