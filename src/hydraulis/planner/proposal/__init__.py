"""Data-aware strategy proposal: generate the deployment pool from the length distribution.

The published generator runs a dynamic programme over (GPUs x length ranges)
once per possible batch maximum length and keeps the distinct deployments.
It scores a range by its total work divided by its replicas, so it misses
what decides real iterations: a long sequence cannot be divided, every
micro-batch pays a fixed cost and a pipeline bubble, caps force extra
micro-batches, and batches differ from each other.

This proposal keeps the programme as a generator of candidates (with the
published and a data-aware group time, `range_dp.py`) and adds the
homogeneous deployments and large-plus-small mixes. It then samples global
batches, plans every sample on every promising candidate with the real
planner and simulator, and builds the pool greedily: first the homogeneous
fallback that holds the longest sequence, then, one at a time, the candidate
that most lowers the mean iteration time when the planner picks the best pool
deployment per batch. Diversity follows from that objective: a deployment
enters only if the planner would actually choose it for some batches; its
usage is its share of the samples' tokens as the planner chose, whole or in
phases, and one that ends up with none leaves the pool again. Deployments for
phases, which no whole sample chooses, come last (`phased.phase_deployments`).

Modules: `propose.py` (the pool), `screen.py` (which candidates to plan), `refine.py` (a local
search around the best), `range_dp.py` (the range programme that generates candidates), `phased.py` (the
deployments for phases).
"""
