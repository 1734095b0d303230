"""The pipeline: a replica's step through its stages (step.py), as 1F1B (one_f_one_b.py) or interleaved
1F1B with vp model chunks per rank (interleaved.py), over point-to-point lanes that carry no shape (lane.py)."""
