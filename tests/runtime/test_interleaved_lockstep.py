"""The interleaved executor's lockstep ticks (runtime/interleaved.py) against the simulator's order (no ranks)."""

from __future__ import annotations

import pytest

from hydraulis.pipeline_order import BACKWARD, FORWARD, interleaved_order
from hydraulis.runtime.pipeline.interleaved import lockstep, message


@pytest.mark.parametrize(("pp", "vp"), [(2, 2), (2, 4), (3, 2), (4, 2), (4, 3)])
def test_ticks_run_each_stages_order_and_every_input_arrives_a_tick_before_its_event(pp, vp):
    for m in range(1, 3 * pp + 2):
        ticks = lockstep(pp, vp, m)
        tick_of = {}
        for t, row in enumerate(ticks):
            assert any(row)  # no tick where every stage waits
            for s, event in enumerate(row):
                if event is not None:
                    tick_of[s, event] = t
        for s in range(pp):
            ran = [row[s] for row in ticks if row[s] is not None]
            assert ran == interleaved_order(pp, vp, m, s)
        sent = 0
        for (s, event), t in tick_of.items():
            out = message(pp, vp, s, event)
            if out is None:
                continue
            sent += 1
            to, taker = out
            assert taker[:2] == event[:2] and tick_of[to, taker] > t, (pp, vp, m, s, event)
        # Each micro-batch crosses the pp vp - 1 boundaries between virtual stages once forward, once backward.
        assert sent == 2 * m * (pp * vp - 1)


def test_messages_go_to_the_next_virtual_stage_forward_and_the_previous_backward():
    # pp 2, vp 2: virtual stages 0 (stage 0 chunk 0), 1 (stage 1 chunk 0), 2 (stage 0 chunk 1), 3 (stage 1 chunk 1)
    assert message(2, 2, 1, (FORWARD, 5, 0)) == (0, (FORWARD, 5, 1))  # the last stage's chunk 0 feeds the first's 1
    assert message(2, 2, 0, (FORWARD, 5, 1)) == (1, (FORWARD, 5, 1))
    assert message(2, 2, 1, (FORWARD, 5, 1)) is None  # the head
    assert message(2, 2, 0, (BACKWARD, 5, 1)) == (1, (BACKWARD, 5, 0))
    assert message(2, 2, 0, (BACKWARD, 5, 0)) is None  # the embedding
