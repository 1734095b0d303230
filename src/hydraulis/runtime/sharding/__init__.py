"""The optimizer's fixed sharded layout and its exchange with the replicas: the striped layout, the owners'
AdamW, the gather/reduce rounds, their overlap with compute, the 2-byte gradient sums.
"""
