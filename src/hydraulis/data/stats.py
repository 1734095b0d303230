"""Length statistics: how long-tailed a corpus is, and how much of the attention cost its tail carries.

numpy only (matplotlib is imported lazily for the plot), so the planner-only
install can use it. The headline number is `top1_sq_share`: the share of
sum(s^2) contributed by the longest 1% of sequences. Attention time is
quadratic in each sequence's length, so this is what makes batches and
replicas imbalanced even when their token counts are equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.errors import HydraulisError

THRESHOLDS = (4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class LengthStats:
    """Summary of a length distribution (lengths in tokens)."""

    count: int
    tokens: int
    mean: float
    p50: int
    p90: int
    p99: int
    max: int
    share_above: dict[int, float]  # fraction of sequences longer than each threshold
    token_share_above: dict[int, float]  # fraction of tokens in those sequences
    top1_sq_share: float  # fraction of sum(s^2) from the longest 1% of sequences

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "tokens": self.tokens,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
            "share_above": {str(k): v for k, v in self.share_above.items()},
            "token_share_above": {str(k): v for k, v in self.token_share_above.items()},
            "top1_sq_share": self.top1_sq_share,
        }


def length_stats(lengths: Sequence[int] | np.ndarray) -> LengthStats:
    """Count, tokens, percentiles (actual sample values), tail shares and the quadratic share of the top 1%."""
    s = np.asarray(lengths, dtype=np.int64)
    if s.ndim != 1 or len(s) == 0:
        raise HydraulisError("length statistics need at least one sequence")
    if np.any(s < 1):
        raise HydraulisError("sequence lengths must be positive")
    p50, p90, p99 = (int(v) for v in np.percentile(s, [50, 90, 99], method="inverted_cdf"))
    total = int(s.sum())
    sq = s.astype(np.float64) ** 2
    top = max(1, math.ceil(0.01 * len(s)))
    top_sq = float(np.sort(sq)[-top:].sum())
    return LengthStats(
        count=len(s),
        tokens=total,
        mean=total / len(s),
        p50=p50,
        p90=p90,
        p99=p99,
        max=int(s.max()),
        share_above={t: float(np.mean(s > t)) for t in THRESHOLDS},
        token_share_above={t: float(s[s > t].sum() / total) for t in THRESHOLDS},
        top1_sq_share=top_sq / float(sq.sum()),
    )


def plot_histogram(lengths: Sequence[int] | np.ndarray, out: str | Path, title: str = "") -> Path:
    """A histogram of lengths on a log x-axis (log-spaced bins), with the 4K-32K thresholds marked."""
    s = np.asarray(lengths, dtype=np.int64)
    if len(s) == 0:
        raise HydraulisError("cannot plot an empty length distribution")
    from hydraulis.plots import check_plot_path, pyplot, save_figure

    out = check_plot_path(out)

    plt = pyplot()
    lo, hi = max(1, int(s.min())), max(2, int(s.max()))
    bins = np.geomspace(lo, hi * 1.0001, num=min(60, max(10, int(np.sqrt(len(s))))))
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        ax.hist(s, bins=bins, color="#3b6ea5")
        ax.set_xscale("log")
        ax.set_xlabel("sequence length (tokens, log scale)")
        ax.set_ylabel("sequences")
        for t in THRESHOLDS:
            if lo < t < hi:
                ax.axvline(t, color="#c0392b", linestyle=":", linewidth=1)
                ax.text(t, ax.get_ylim()[1] * 0.95, f"{t // 1024}K", color="#c0392b", ha="left", va="top")
        st = length_stats(s)
        ax.set_title(title or f"{st.count} sequences, {st.tokens:,} tokens")
        fig.tight_layout()
        save_figure(fig, out, dpi="figure")
    finally:
        plt.close(fig)
    return out
