"""Hugging Face weights in: their configs and names (hf.py), and loading them into the owned shards (hf_io.py)."""
