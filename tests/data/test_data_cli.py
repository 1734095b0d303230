from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from hydraulis.data.workload import WORKLOAD_SCHEMA, load_workload


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))



@pytest.fixture
def messy(tmp_path: Path) -> Path:
    """A directory with every kind of bad input the readers handle."""
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    (src / "docs.jsonl").write_bytes(b'{"text": "hello there"}\n\n{"title": "no text"}\n{"text": "caf\xe9"}\n')
    (src / "sub" / "a.txt").write_text("a plain text document " * 50, encoding="utf-8")
    (src / "sub" / "empty.txt").write_text("  \n", encoding="utf-8")
    (src / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    return src


def test_build_report_stats_and_plot(cli, tmp_path: Path, messy: Path) -> None:  # noqa: ANN001
    out = tmp_path / "corpus"
    res = cli("data", "build", str(messy), "--out", str(out), "--tokenizer", "bytes", "--skip-missing", "--json")
    assert res.returncode == 0, res.stderr
    manifest = json.loads(res.stdout)
    assert manifest["documents"] == 3 and manifest["tokenizer"]["name"] == "bytes"
    assert manifest["input"] == {
        "files": 4,
        "documents": 3,
        "non_utf8_replaced": 1,
        "empty_skipped": 1,
        "binary_skipped": 1,
        "missing_field_skipped": 1,
        "blank_lines": 1,
        "sft_records": 0,
        "no_target_skipped": 0,
    }
    res = cli("data", "stats", str(out), "--json", "--plot", str(tmp_path / "h.svg"), "--max-len", "600")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["count"] == 3 and st["max"] == len("a plain text document " * 50) + 1
    # The plot marks the user's max_len (matplotlib keeps each text as a comment in the SVG), not 4K-32K lines.
    labels = re.findall(r"<!-- (.*?) -->", (tmp_path / "h.svg").read_text())
    assert "max_len 600: 33.3% of documents (" in " ".join(labels) and "4K" not in labels, labels
    res = cli("data", "stats", str(out))
    assert res.returncode == 0 and "top1% s²" in res.stdout and "p99" in res.stdout


def test_build_errors_leave_nothing_behind(cli, tmp_path: Path, messy: Path) -> None:  # noqa: ANN001
    out = tmp_path / "corpus"
    msg = one_line_error(cli("data", "build", str(messy), "--out", str(out)))
    assert "docs.jsonl:3: no field 'text'" in msg and "--skip-missing" in msg
    assert not out.exists() and hidden(tmp_path) == []
    msg = one_line_error(cli("data", "build", str(tmp_path / "nope"), "--out", str(out)))
    assert "no such file or directory" in msg
    msg = one_line_error(cli("data", "build", str(messy), "--out", str(out), "--tokenizer", "wordpiece"))
    assert "unknown tokenizer 'wordpiece'" in msg
    assert not out.exists() and hidden(tmp_path) == []


def test_existing_output_and_force(cli, tmp_path: Path) -> None:  # noqa: ANN001
    src = tmp_path / "one.txt"
    src.write_text("just one document", encoding="utf-8")
    out = tmp_path / "c"
    assert cli("data", "build", str(src), "--out", str(out), "-t", "bytes").returncode == 0
    assert "already exists" in one_line_error(cli("data", "build", str(src), "--out", str(out), "-t", "bytes"))
    res = cli("data", "build", str(src), "--out", str(out), "-t", "gpt2", "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["name"] == "gpt2"
    (out / "index.idx").write_bytes((out / "index.idx").read_bytes()[:-3])
    msg = one_line_error(cli("data", "stats", str(out)))
    assert str(out / "index.idx") in msg and "truncated" in msg
    # A path that is not there says so, and where it was looked for (relative: in the current directory).
    msg = one_line_error(cli("data", "stats", "no-such-corpus", cwd=tmp_path))
    assert msg.startswith(f"error: {tmp_path / 'no-such-corpus'}: no such file or directory, and not a built-in"), msg
    assert "a relative path is read from the current directory" in msg


def test_stats_of_a_mixture_draw_each_source_at_its_weight(cli, tmp_path: Path) -> None:  # noqa: ANN001
    """20 short documents (11 bytes) and 20 long ones (101) at equal weights: one mixture epoch serves as many
    tokens as both hold (2,240), half from each, so the short ones are drawn about 5 times over."""
    from hydraulis.data.build.corpus import build_corpus

    build_corpus(["s" * 10] * 20, tmp_path / "short", "bytes", "short", name="short")
    build_corpus(["l" * 100] * 20, tmp_path / "long", "bytes", "long", name="long")
    res = cli("data", "stats", str(tmp_path / "short"), str(tmp_path / "long"), "--weights", "1,1", "-t", "bytes",
              "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert [(s["corpus"], s["weight"], s["count"]) for s in st["sources"]] == [("short", 0.5, 20), ("long", 0.5, 20)]
    assert abs(st["tokens"] - 2240) <= 101 and st["p50"] == 11
    assert 1120 // 11 + 1120 // 101 <= st["count"] <= 1120 // 11 + 1120 // 101 + 2
    res = cli("data", "stats", str(tmp_path / "short"), str(tmp_path / "long"), "--weights", "3,1", "-t", "bytes")
    assert res.returncode == 0 and "short (75.0%)" in res.stdout and "mixture (one epoch)" in res.stdout
    msg = one_line_error(cli("data", "stats", str(tmp_path / "short"), str(tmp_path / "long"), "-t", "bytes"))
    assert "several corpora are a mixture: give --weights, one positive weight per corpus (2)" in msg
    msg = one_line_error(cli("data", "stats", str(tmp_path / "short"), str(tmp_path / "long"), "--weights", "1,0"))
    assert "--weights '1,0'" in msg


def test_builtin_by_name(cli, tmp_path: Path) -> None:  # noqa: ANN001
    res = cli("data", "build", "wiki-sample", "--out", str(tmp_path / "w"), "--tokenizer", "bytes")
    assert res.returncode == 0, res.stderr
    assert "206 documents" in res.stdout
    res = cli("data", "stats", "wiki-sample", "--tokenizer", "bytes", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["count"] == 206


def test_workload(cli, tmp_path: Path) -> None:  # noqa: ANN001
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": "w " * (5 * (i % 37) ** 2 + 3)}) for i in range(400)]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = tmp_path / "c"
    assert cli("data", "build", str(src), "--out", str(corpus), "-t", "bytes").returncode == 0
    args = ["--corpus", str(corpus), "--tokens-per-batch", "20000", "--batches", "12", "--max-len", "4096"]
    res = cli("workload", *args, "--seed", "5", "--out", str(tmp_path / "w1.json"))
    assert res.returncode == 0, res.stderr
    w = load_workload(tmp_path / "w1.json")
    assert json.loads((tmp_path / "w1.json").read_text())["schema"] == WORKLOAD_SCHEMA
    assert len(w.batches) == 12
    assert all(b.sum() <= 20000 and b.max() <= 4096 for b in w.batches)
    assert sum(int(b.sum()) for b in w.batches) > 0.8 * 12 * 20000  # filled to the budget (pieces are at most 4096)
    assert cli("workload", *args, "--seed", "5", "--out", str(tmp_path / "w2.json")).returncode == 0
    assert (tmp_path / "w1.json").read_bytes() == (tmp_path / "w2.json").read_bytes()
    assert cli("workload", *args, "--seed", "6", "--out", str(tmp_path / "w3.json")).returncode == 0
    assert (tmp_path / "w1.json").read_bytes() != (tmp_path / "w3.json").read_bytes()
    # Over-long documents follow --overlong, the name `data build`, `data stats`, `plan` and [data] give it;
    # --policy is the planner's (`plan --policy`), not an over-long policy.
    dropped = cli("workload", *args, "--seed", "5", "--overlong", "drop", "--out", str(tmp_path / "w4.json"))
    assert dropped.returncode == 0, dropped.stderr
    assert (tmp_path / "w4.json").read_bytes() != (tmp_path / "w1.json").read_bytes()
    assert "No such option: --policy" in one_line_error(
        cli("workload", *args, "--policy", "drop", "--out", str(tmp_path / "w5.json")))
    assert "--overlong 'cut'" in one_line_error(
        cli("workload", *args, "--overlong", "cut", "--out", str(tmp_path / "w5.json")))

    bad = [
        "--corpus",
        str(corpus),
        "--tokens-per-batch",
        "1000",
        "--max-len",
        "4096",
        "--out",
        str(tmp_path / "x.json"),
    ]
    assert "above the batch budget" in one_line_error(cli("workload", *bad))
    assert not (tmp_path / "x.json").exists()
