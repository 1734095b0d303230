"""Data: workloads (length distributions), and later tokenizers, corpora and samplers."""
