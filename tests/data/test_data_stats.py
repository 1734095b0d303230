from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hydraulis.data.stats import length_stats, plot_histogram
from hydraulis.errors import HydraulisError


def test_known_distribution() -> None:
    lengths = np.array([10] * 99 + [1000])
    st = length_stats(lengths)
    assert (st.count, st.tokens, st.max) == (100, 1990, 1000)
    assert (st.p50, st.p90, st.p99) == (10, 10, 10)
    assert st.top1_sq_share == pytest.approx(1000**2 / (1000**2 + 99 * 100))
    assert st.share_above == {4096: 0.0, 8192: 0.0, 16384: 0.0, 32768: 0.0}


def test_tail_shares() -> None:
    lengths = np.array([1000, 5000, 9000, 20000, 40000])
    st = length_stats(lengths)
    assert st.share_above == {4096: 0.8, 8192: 0.6, 16384: 0.4, 32768: 0.2}
    assert st.token_share_above[32768] == pytest.approx(40000 / 75000)
    assert st.top1_sq_share == pytest.approx(40000**2 / float(np.sum(lengths.astype(float) ** 2)))
    assert st.p50 == 9000 and st.max == 40000
    d = st.to_dict()
    assert d["share_above"]["4096"] == 0.8 and d["count"] == 5


def test_percentiles_are_sample_values() -> None:
    lengths = np.arange(1, 1001)
    st = length_stats(lengths)
    assert (st.p50, st.p90, st.p99) == (500, 900, 990)
    assert length_stats([7]).top1_sq_share == 1.0


def test_bad_input() -> None:
    with pytest.raises(HydraulisError, match="at least one sequence"):
        length_stats([])
    with pytest.raises(HydraulisError, match="positive"):
        length_stats([3, 0])


def test_plot(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(7, 1.5, 2000).astype(int))
    out = plot_histogram(lengths, tmp_path / "h.png", title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.png"]
    with pytest.raises(HydraulisError, match="must end in .png"):
        plot_histogram(lengths, tmp_path / "h.txt")
    with pytest.raises(HydraulisError, match="is a directory"):
        plot_histogram(lengths, tmp_path)
    # Like every output, a plot creates its directory.
    assert plot_histogram(lengths, tmp_path / "new" / "h.png").is_file()


def test_plots_go_through_the_shared_atomic_save(tmp_path, monkeypatch):
    import hydraulis.plots

    saved = []
    real = hydraulis.plots.save_figure
    monkeypatch.setattr(
        hydraulis.plots, "save_figure", lambda fig, path, **kw: saved.append(path) or real(fig, path, **kw)
    )
    out = plot_histogram(np.array([100, 2000, 30000] * 20), tmp_path / "h.svg")
    assert saved == [out]
    labels = re.findall(r"<!-- (.*?) -->", out.read_text())
    assert {"4K", "8K", "16K"} <= set(labels)  # no max_len: the stats table's thresholds
    assert out.read_text()[:200].lstrip().startswith("<?xml")
    assert [p.name for p in tmp_path.iterdir()] == ["h.svg"]  # no temporary left behind
