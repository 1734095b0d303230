"""Schedules beyond (interleaved) 1F1B, timed on the simulator's terms: chunked long sequences (`chunk_schedule.py`,
an oracle), and the backward split into B and W: its continuous oracle (`zero_bubble.py`) and the schedule the
planner plans from it, each stage's W's at whole slots in its gaps (`deferral.py`, `ReplicaPlan.deferral`)."""
