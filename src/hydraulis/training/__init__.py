"""The training job: its config, the checks before any rank starts, the loop every rank runs, the run log,
checkpoints and resume, the measured profile and its cache, the run's fidelity.
"""
