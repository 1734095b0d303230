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


def plot_histogram(
    lengths: Sequence[int] | np.ndarray, out: str | Path, title: str = "", max_len: int | None = None
) -> Path:
    """A histogram of lengths on a log x-axis (log-spaced bins), with `max_len` marked (and the share of the
    documents and tokens beyond it); without one, the 4K-32K thresholds of the stats table."""
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
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the labels above the bars
        if max_len is not None:
            over = s > max_len
            ax.set_xlim(min(ax.get_xlim()[0], max_len / 1.5), max(ax.get_xlim()[1], max_len * 1.5))
            ax.axvline(max_len, color="#c0392b", linestyle="--", linewidth=1.2)
            ax.text(0.02, 0.96, f"max_len {max_len:,}: {over.mean():.1%} of documents "
                    f"({s[over].sum() / s.sum():.1%} of tokens) are longer", transform=ax.transAxes,
                    color="#c0392b", ha="left", va="top", fontsize=9,
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
        _length_ticks(ax)
        for t in THRESHOLDS if max_len is None else ():
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


def _length_ticks(ax) -> None:  # noqa: ANN001
    """Powers of two on the log length axis, as 256, 1K, 32K (not 3x10^2 beside 4x10^2)."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    lo, hi = ax.get_xlim()
    ticks = [1 << k for k in range(0, 40) if lo <= 1 << k <= hi]
    ticks = ticks[:: max(1, len(ticks) // 8 + (len(ticks) % 8 > 0))]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticks(ticks, [f"{t >> 10}K" if t >= 1024 else str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
