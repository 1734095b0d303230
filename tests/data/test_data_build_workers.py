"""A build on several workers: the corpus of one worker to the byte, and a SIGKILL at any moment loses nothing.

Chunks are CHUNK_DOCS documents at most, so a few thousand short records make several parts; the SIGKILL
test runs the real command with smaller chunks (the script sets them) to kill it between many parts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import SRC
from test_data_sft import CHATS, GENERATION_CHATML, PAIRS, write_jsonl
from tokenizer_helpers import train_bpe

from hydraulis.data.build import corpus as building
from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import MANIFEST_FILE, open_corpus
from hydraulis.data.readers import InputOptions, ReadCounts
from hydraulis.data.records import SkippableRecord
from hydraulis.data.sources import read_source
from hydraulis.data.tokenizer import ByteTokenizer, get_tokenizer
from hydraulis.errors import HydraulisError
from hydraulis.processes.stream_map import WorkerLost

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = ("the", "corpus", "is", "read", "in", "chunks", "and", "each", "tokenized", "by", "a", "worker")


def texts(n: int, seed: int, words: int = 30) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, words))) + f" {i}" for i in range(n)]


def corpus_files(path: Path) -> dict[str, bytes]:
    """Every file of a corpus; the manifest without its name (the directory's)."""
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    manifest = json.loads(files.pop(MANIFEST_FILE))
    manifest.pop("name")
    files[MANIFEST_FILE] = json.dumps(manifest).encode()
    return files


def test_two_workers_build_one_workers_corpus_from_jsonl_and_parquet(cli, tmp_path: Path) -> None:  # noqa: ANN001
    src = tmp_path / "src"
    src.mkdir()
    lines, rows = texts(2500, 0), texts(1500, 1)
    lines[7] = "scraped text with a lone \ud83d surrogate, escaped in its json line"
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in rows]), src / "b.parquet", row_group_size=500)
    built = {}
    for workers in (1, 2):
        res = cli("data", "build", str(src), "--out", str(tmp_path / f"w{workers}"), "--workers", str(workers))
        assert res.returncode == 0, res.stderr
        assert "MB/s of input" in res.stdout and "tokens/s" in res.stdout
        built[workers] = corpus_files(tmp_path / f"w{workers}")
    assert built[1] == built[2]
    corpus = open_corpus(tmp_path / "w2", verify=True)
    tok = get_tokenizer("gpt2")
    assert len(corpus) == 4000 and corpus.manifest.report.blank_lines == 1
    for i in (0, 7, 1023, 1024, 2499, 2500, 3999):  # either side of the chunks' edges, and of the files'
        text = (lines + rows)[i]  # against tiktoken's own encode_ordinary, not the build's encode
        assert corpus[i].tolist() == tok.encoding.encode_ordinary(text) + [tok.eod_id]
    assert not list(tmp_path.glob(".w2.*"))  # neither parts nor temporaries left


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "bpe", chat_template=GENERATION_CHATML)


def sft_build(src: Path, out: Path, tokenizer: str, workers: int, skip_bad: bool = False):  # noqa: ANN201
    counts = ReadCounts()
    docs = read_source(src, counts, InputOptions())
    return build_corpus(docs, out, tokenizer, str(src), counts, skip_bad=skip_bad, workers=workers)


def test_sft_chat_records_on_two_workers_equal_one_worker(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(building, "CHUNK_DOCS", 7)  # parts of text only, of chats only, and mixed
    records: list[dict] = [{"text": t} for t in texts(10, 2)]
    records += [{"messages": CHATS[i % 2]} for i in range(12)]
    records += [{"prompt": p, "completion": c} for p, c in PAIRS * 3]
    records += [{"messages": [{"role": "user", "content": "hi"}]}]  # no target: skipped with skip_bad
    records += [{"text": t} for t in texts(5, 3)]
    src = write_jsonl(tmp_path / "sft.jsonl", records)
    sft_build(src, tmp_path / "one", str(tok_dir), 1, skip_bad=True)
    two = sft_build(src, tmp_path / "two", str(tok_dir), 2, skip_bad=True)
    assert corpus_files(tmp_path / "one") == corpus_files(tmp_path / "two")
    m = two.manifest
    assert m.masked and m.documents == len(records) - 1 and m.report.no_target_skipped == 1
    assert m.report.sft_records == 12 + len(PAIRS) * 3
    assert two.target_mask(0).all() and not two.target_mask(10).all()  # texts before the first chat: ones
    with pytest.raises(SkippableRecord, match=r"sft\.jsonl:32: no assistant turn.*--skip-bad"):
        sft_build(src, tmp_path / "bad", str(tok_dir), 2)  # raised in a worker, raised again here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "sft.jsonl", "two"]  # bad input: nothing left


@dataclass(frozen=True)
class DyingTokenizer(ByteTokenizer):
    """Bytes, except that a worker given the text "die" is killed (as the kernel's OOM killer would)."""

    parent: int = 0

    def encode(self, text: str) -> np.ndarray:
        if text == "die" and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode(text)


def test_a_worker_killed_is_an_error_not_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(building, "CHUNK_DOCS", 2)
    tok = DyingTokenizer(parent=os.getpid())
    docs = ["a", "b", "c", "d", "die", "e", "f", "g"]
    with pytest.raises(WorkerLost, match="a worker process died without a result"):
        build_corpus(docs, tmp_path / "c", tok, "t", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no resume key: nothing a next build could use
    assert len(build_corpus(docs, tmp_path / "c", tok, "t", workers=1)) == 8  # in this process: no worker to kill


KILLABLE = """
import sys
from hydraulis.data.build import corpus
corpus.CHUNK_DOCS = 40  # many parts, so that a kill lands between them
from hydraulis.cli import main
sys.argv = ["hydraulis", "data", "build", sys.argv[1], "--out", sys.argv[2], "--workers", "2"]
main()
"""


def start(src: Path, out: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-c", KILLABLE, str(src), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished_parts(out: Path) -> int:
    return len(list(out.parent.glob(f".{out.name}.parts/*.json")))


def workers_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except OSError:
        return True


def test_a_build_killed_at_random_moments_leaves_no_corpus_and_the_next_finishes_it(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t * 5} for t in texts(2400, 4, words=60)])
    reference = tmp_path / "reference"
    done = start(src, reference)
    assert done.wait(120) == 0, done.communicate()
    parts = 2400 // 40
    out = tmp_path / "c"
    rng = random.Random(53)
    for at in sorted(rng.sample(range(1, parts // 2), 3)):  # after `at` finished parts, of all builds so far
        proc = start(src, out)
        while finished_parts(out) < at and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.02))
        children = workers_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL, "the build ended before the kill"
        deadline = time.monotonic() + 10
        while not all(gone(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(gone(c) for c in children), "a worker outlived its killed build"
        if out.exists():  # killed after it published (as it exited): whole, then
            assert corpus_files(out) == corpus_files(reference)
            shutil.rmtree(out)
        for left in [out, *tmp_path.glob(".c.*")]:  # the corpus, its temporaries, its parts: none is one
            with pytest.raises(HydraulisError):
                open_corpus(left)
    proc = start(src, out)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    reused = [line for line in stderr.splitlines() if line.startswith("reused ")]
    assert reused and int(reused[0].split()[1]) >= 1, stderr
    assert corpus_files(out) == corpus_files(reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "docs.jsonl", "reference"]
    assert np.array_equal(open_corpus(out, verify=True).lengths, open_corpus(reference).lengths)


def test_a_stale_cache_corpus_another_rank_rebuilt_while_this_one_waited_is_kept(tmp_path: Path) -> None:
    """Under torchrun every rank finds the cache's corpus stale and asks to replace it; the first one to hold
    the lock rebuilds it, and the others take that build instead of tokenizing everything again in turn."""
    source = "builtin:test (fingerprint 1)"
    documents = texts(50, 2)
    out = tmp_path / "cache-corpus"
    first = build_corpus(iter(documents), out, "bytes", source, if_exists="replace", resume=source, workers=1)

    def untouched():  # noqa: ANN202
        raise AssertionError("the documents were read again")
        yield

    again = build_corpus(untouched(), out, "bytes", source, if_exists="replace", resume=source, workers=1)
    assert again.path == first.path and len(again) == 50
    # Another source is a real replacement: built again.
    other = build_corpus(iter(documents[:10]), out, "bytes", "builtin:test (fingerprint 2)", if_exists="replace",
                         resume="builtin:test (fingerprint 2)", workers=1)  # fmt: skip
    assert len(other) == 10
