"""The embedded profanity classifier: alt-profanity-check's model, compiled to a dictionary lookup.

alt-profanity-check (PyPI, scikit-learn) is a TF-IDF bag of words (unigrams `\\b\\w\\w+\\b` on lower-cased text,
English stop words dropped, L2-normalised) fed to five linear SVMs, each calibrated by a sigmoid
(CalibratedClassifierCV), whose probabilities are averaged. Calling its `predict_proba` costs a scikit-learn
round trip (about 0.1-8 ms for one short text), far over a per-chunk budget of a few tens of microseconds.

Because the model is linear, it folds into one table built once from the package's own fitted objects:
token -> (idf, idf * w_1..w_5). The probability of a bag of tokens with counts c_t is then

    x_t = c_t * idf_t,   d_k = sum_t c_t * (idf_t * w_kt) / ||x|| + b_k,   p = mean_k 1 / (1 + exp(A_k d_k + B_k))

which is exactly scikit-learn's result (a test checks them against `profanity_check.predict_prob`), at the cost
of a few dictionary lookups per word.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TOKEN = re.compile(r"\b\w\w+\b")


@dataclass(frozen=True)
class ProfanityModel:
    """The compiled model: per-token idf and idf-weighted SVM coefficients, per-SVM intercept and calibration."""

    idf: dict[str, float]
    weights: dict[str, tuple[float, ...]]
    intercepts: tuple[float, ...]
    calibration: tuple[tuple[float, float], ...]

    def score_tokens(self, tokens: Iterable[str]) -> float:
        """Probability of profanity for a bag of lower-cased tokens."""
        idf = self.idf
        counts: dict[str, int] = {}
        for t in tokens:
            if t in idf:
                counts[t] = counts.get(t, 0) + 1
        sums = [0.0] * len(self.intercepts)
        norm2 = 0.0
        weights = self.weights
        if len(sums) == 5:  # alt-profanity-check's five folds, unrolled: this loop is the classifier's hot spot
            s0 = s1 = s2 = s3 = s4 = 0.0
            for token, count in counts.items():
                x = count * idf[token]
                norm2 += x * x
                w0, w1, w2, w3, w4 = weights[token]
                s0 += count * w0
                s1 += count * w1
                s2 += count * w2
                s3 += count * w3
                s4 += count * w4
            sums = [s0, s1, s2, s3, s4]
        else:
            for token, count in counts.items():
                x = count * idf[token]
                norm2 += x * x
                sums = [s + count * w for s, w in zip(sums, weights[token])]
        norm = math.sqrt(norm2) or 1.0
        total = 0.0
        for s, b, (a, c) in zip(sums, self.intercepts, self.calibration):
            z = a * (s / norm + b) + c
            total += 1.0 / (1.0 + math.exp(z)) if z < 700 else 0.0
        return total / len(self.intercepts)

    def score(self, text: str) -> float:
        return self.score_tokens(tokens(text))

    def leans_profane(self, token: str) -> bool:
        """Whether the token pushes the SVMs towards profanity (its mean weight is positive)."""
        w = self.weights.get(token)
        return w is not None and sum(w) > 0


def tokens(text: str) -> list[str]:
    return [m.group().lower() for m in TOKEN.finditer(text)]


def compile_model(vectorizer: object, calibrated: object) -> ProfanityModel:
    """Folds a fitted TfidfVectorizer and a CalibratedClassifierCV(LinearSVC) into a ProfanityModel."""
    vocabulary: dict[str, int] = getattr(vectorizer, "vocabulary_")
    idf_values: Sequence[float] = getattr(vectorizer, "idf_")
    folds = getattr(calibrated, "calibrated_classifiers_")
    coefs = [fold.estimator.coef_[0] for fold in folds]
    idf = {token: float(idf_values[i]) for token, i in vocabulary.items()}
    weights = {token: tuple(float(idf_values[i] * c[i]) for c in coefs) for token, i in vocabulary.items()}
    intercepts = tuple(float(fold.estimator.intercept_[0]) for fold in folds)
    calibration = tuple((float(fold.calibrators[0].a_), float(fold.calibrators[0].b_)) for fold in folds)
    return ProfanityModel(idf, weights, intercepts, calibration)


@functools.cache
def profanity_model() -> ProfanityModel:
    """The model shipped in alt-profanity-check, compiled once per process (loading takes a few seconds)."""
    from profanity_check import profanity_check as package

    return compile_model(package.vectorizer, package.model)
