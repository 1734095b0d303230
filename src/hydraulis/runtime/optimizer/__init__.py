"""The optimizer: each rank's owner shard of master weights and AdamW state, and the exchange with the
deployment's compute shards (gather, then reduce), in the rounds of an exchange plan, beside compute or not.
"""
