"""What a run keeps on disk: distributed checkpoints, Hugging Face weights in and out, the run directory."""
