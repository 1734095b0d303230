"""Data: from real text to the sequence lengths the planner balances.

tokenizer (GPT-2 offline, bytes) -> readers (jsonl, text, directories) ->
indexed (memory-mapped corpus) -> builtin (python-stdlib, bbc-news,
wiki-sample; `corpus_lengths`) -> sampler (token-budget global batches) ->
stats (long-tail statistics) and workload (`hydraulis.workload/1`).
Nothing here imports torch; tiktoken and matplotlib are imported lazily.
"""
