"""Hydraulis: heterogeneous, dynamic parallel training on variable-length data."""

__version__ = "0.1.0"
