"""The expected time of a profile (profile_cache.expected_s): from the model being profiled, not another's."""

from __future__ import annotations

import pytest

from hydraulis.cost import profile_cache

HERE = {"device": "cpu", "device_name": "cpu", "cores": 2}


def test_another_models_profile_scales_this_models_analytic_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRAULIS_CACHE", str(tmp_path))
    assert profile_cache.expected_s(HERE, 40, "small", None) is None
    assert profile_cache.expected_s(HERE, 40, "small", 3.0)[0] == 3.0  # a first profile: compute only
    # A big model took 60 s over 40 steps, 3x its 20 s of analytic compute; a small one's 40 steps compute 2 s.
    profile_cache.record_timing(HERE, 40, 60.0, "big", 20.0)
    seconds, source = profile_cache.expected_s(HERE, 40, "small", 2.0)
    assert seconds == pytest.approx(6.0) and "other models'" in source  # not 60 s: its steps cost less
    profile_cache.record_timing(HERE, 40, 10.0, "small", 2.0)  # the small model itself: 5x
    seconds, source = profile_cache.expected_s(HERE, 80, "small", 4.0)
    assert seconds == pytest.approx(20.0) and "this model's" in source
    assert profile_cache.expected_s({**HERE, "cores": 8}, 40, "small", None) is None  # another machine
    assert profile_cache.expected_s(HERE, 80, "small", None)[0] == pytest.approx(20.0)  # its own rate per step
