"""Building a corpus: the input read in chunks, tokenized on every core, assembled and published atomically."""
