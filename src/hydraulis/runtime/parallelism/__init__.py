"""How a replica splits its work: process groups, tensor, pipeline (1F1B) and context parallelism, documents
packed into micro-batches.
"""
