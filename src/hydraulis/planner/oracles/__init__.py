"""Oracles of schedules the runtime does not run, timed on the simulator's terms: chunked long sequences
(`chunk_schedule.py`) and the zero-bubble split of the backward (`zero_bubble.py`). What a schedule could gain on a
plan, before anyone builds it."""
