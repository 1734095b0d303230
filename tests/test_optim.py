"""The learning-rate schedule against values worked out by hand (nothing here calls code shared with lr_at)."""

from __future__ import annotations

import pytest

from hydraulis.optim import OptimSettings

# lr 1e-3, warm-up 2, 8 steps, floor 1e-4. After warm-up, progress = (step - 2) / 5, and
# cosine: 1e-4 + 9e-4 * (1 + cos(pi * progress)) / 2 with cos(pi/5) = 0.80901699437, cos(2pi/5) = 0.30901699437.
COSINE = [5e-4, 1e-3, 1e-3, 9.1405764747e-4, 6.8905764747e-4, 4.1094235253e-4, 1.8594235253e-4, 1e-4]
LINEAR = [5e-4, 1e-3, 1e-3, 8.2e-4, 6.4e-4, 4.6e-4, 2.8e-4, 1e-4]  # 1e-3 - 9e-4 * progress
CONSTANT = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]


@pytest.mark.parametrize(("schedule", "expected"), [("cosine", COSINE), ("linear", LINEAR), ("constant", CONSTANT)])
def test_lr_at_matches_hand_computed_values(schedule, expected):
    settings = OptimSettings(lr=1e-3, warmup=2, schedule=schedule, min_lr_ratio=0.1)
    got = [settings.lr_at(step, 8) for step in range(8)]
    assert got == pytest.approx(expected, rel=1e-9, abs=0)


def test_lr_without_warmup_starts_at_the_peak_and_holds_the_floor_past_the_end():
    settings = OptimSettings(lr=2e-3, warmup=0, schedule="cosine", min_lr_ratio=0.25)
    # 5 steps: progress = step / 4; cos(pi/4) = 0.70710678119.
    assert settings.lr_at(0, 5) == pytest.approx(2e-3, rel=1e-12)
    assert settings.lr_at(1, 5) == pytest.approx(5e-4 + 1.5e-3 * 0.85355339059, rel=1e-9)
    assert settings.lr_at(2, 5) == pytest.approx(1.25e-3, rel=1e-12)
    assert settings.lr_at(4, 5) == pytest.approx(5e-4, rel=1e-12)
    assert settings.lr_at(9, 5) == pytest.approx(5e-4, rel=1e-12)
