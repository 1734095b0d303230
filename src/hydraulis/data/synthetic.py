"""Synthetic length distributions: a lognormal body plus a lognormal long tail.

Calibrated to public corpus statistics, so that benchmarks are meaningful
before real corpora are at hand:

- wiki: Wikipedia-like articles, median ~300 tokens, p95 ~2.5K, ~0.6% above 8K.
- code: source files, median ~3K tokens, p99 ~80K.
- longmix: a long-context training mix after ProLong (Gao et al., 2024, "How to
  train long-context language models (effectively)"): 40% of the tokens short
  documents (a wiki-like body, median ~350), 30% books (PG-19-like, median
  ~90K tokens) and 30% code repositories concatenated per repository (median
  ~120K, a wide spread). Weights are per document: token share / mean length.

A distribution is a histogram over 1..max_length; lengths above the maximum are
clipped to it (documents are cut into max-length pieces by the data pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from hydraulis.errors import HydraulisError

MIN_LENGTH = 8


@dataclass(frozen=True)
class LognormalMixture:
    """Weights, medians (tokens) and log-space sigmas of lognormal parts."""

    name: str
    weights: tuple[float, ...]
    medians: tuple[float, ...]
    sigmas: tuple[float, ...]

    def cdf(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)[..., None]
        z = (np.log(x) - np.log(np.array(self.medians))) / np.array(self.sigmas)
        return (ndtr(z) * np.array(self.weights)).sum(axis=-1) / sum(self.weights)

    def histogram(self, max_length: int) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, probabilities) over MIN_LENGTH..max_length, the tail clipped onto max_length."""
        if max_length < MIN_LENGTH:
            raise HydraulisError(f"max length must be at least {MIN_LENGTH}, got {max_length}")
        lengths = np.arange(MIN_LENGTH, max_length + 1, dtype=np.int64)
        upper = self.cdf(lengths + 0.5)
        upper[-1] = 1.0
        probs = np.diff(np.concatenate([[0.0], upper]))
        return lengths, probs


MIXTURES: dict[str, LognormalMixture] = {
    m.name: m
    for m in (
        LognormalMixture("wiki", (0.985, 0.015), (295.0, 4000.0), (1.23, 1.05)),
        LognormalMixture("code", (0.92, 0.08), (2600.0, 20000.0), (1.15, 1.1)),
        LognormalMixture("longmix", (0.99286, 0.004967, 0.002172), (350.0, 90000.0, 120000.0), (1.2, 0.6, 1.2)),
    )
}


def get_mixture(name: str) -> LognormalMixture:
    try:
        return MIXTURES[name]
    except KeyError:
        raise HydraulisError(f"unknown synthetic length mixture {name!r}; known: {', '.join(MIXTURES)}") from None
