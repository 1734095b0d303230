"""Planning an iteration: choose a deployment, dispatch sequences, pack micro-batches."""
