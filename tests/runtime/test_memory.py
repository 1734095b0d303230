"""Memory the model predicts against memory torch's allocator measures, on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest
from dist_launcher import run_workers
from exchange_workers import train_small

from hydraulis.run_log import summarize

BUCKET = 4 << 20
STEPS = 3


@pytest.mark.dist
def test_small_on_four_ranks_peaks_as_predicted_and_the_exchange_within_three_buckets():
    metrics = run_workers(train_small, 4, STEPS, BUCKET, deadline_s=400)[0]
    assert len(metrics) == STEPS
    for m in metrics:
        assert 0 < m["exchange_peak_bytes"] <= 3 * BUCKET, m["exchange_peak_bytes"]
        # Every rank's measured peak within 15% of its prediction (memory_error is the worst rank's).
        figures = (m["memory_peak_bytes"], m["memory_predicted_bytes"], m["micro_batches"])
        assert m["memory_error"] <= 0.15, figures
        # Not a vacuous bound: the parameters (31.6M x 4 bytes) and the owned state (31.6M / 4 x 16 bytes)
        # alone are 240 MiB per rank, and the activations of a few hundred tokens about as much again.
        assert m["memory_peak_bytes"] > 300 * 2**20, figures
    summary = summarize(metrics)
    assert summary["exchange_peak_bytes"] == max(m["exchange_peak_bytes"] for m in metrics)
    assert summary["memory_error_max"] <= 0.15
    json.dumps(summary)
