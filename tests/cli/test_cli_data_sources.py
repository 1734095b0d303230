"""A source built into the cache (a `.jsonl` given as a corpus) says on its line what it made no document of, so
that a file of N lines holding fewer documents is explained where the count is read (data/sources.py)."""

from __future__ import annotations

import json


def test_a_source_built_into_the_cache_says_what_it_left_out(cli, tmp_path):
    records = [{"text": "" if i in (7, 90) else f"document {i} " + "words " * (i % 9 + 1)} for i in range(200)]
    lines = [json.dumps(r) for r in records]
    lines.insert(50, "")  # a blank line among the records
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(lines) + "\n")
    res = cli("data", "stats", str(source), "--tokenizer", "bytes")
    assert res.returncode == 0, res.stderr
    said = next(line for line in res.stderr.splitlines() if "built into the cache once" in line)  # beside the table
    empty = sum(1 for r in records if not r["text"])
    assert f"({len(records) - empty} documents," in said, said
    assert said.endswith(f"; left out: {empty} empty, 1 blank line(s)"), said
