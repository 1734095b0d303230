"""Hugging Face tokenizers by path: ids as transformers' own tokenizer makes them, identity, checks, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from test_data_cli import hidden
from tokenizer_helpers import TEXT, train_bpe

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import open_corpus
from hydraulis.data.tokenizer import get_tokenizer
from hydraulis.errors import HydraulisError
from hydraulis.training.config import parse_config

transformers = pytest.importorskip("transformers")

SAMPLES = ["Question: what is the capital of France?", "naïve café 🙂 unseen words", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "bpe")


def test_ids_are_transformers_ids(tok_dir: Path) -> None:
    """The independent reference: AutoTokenizer on the same directory, special tokens included."""
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for spec in (tok_dir, tok_dir / "tokenizer.json"):
        tok = get_tokenizer(str(spec))
        assert tok.eod_id == ref.eos_token_id and tok.vocab_size == len(ref)
        assert tok.prefix == (ref.bos_token_id,)
        for text in SAMPLES:
            assert list(tok.prefix) + tok.encode(text).tolist() == ref(text)["input_ids"]
            assert tok.decode(tok.encode(text)) == text
        assert [a.tolist() for a in tok.encode_batch(SAMPLES)] == [tok.encode(t).tolist() for t in SAMPLES]


def test_identity_is_a_hash_of_the_files(tok_dir: Path, tmp_path: Path) -> None:
    a = get_tokenizer(str(tok_dir))
    assert a.name.startswith("hf-") and len(a.name) == 19
    assert get_tokenizer(str(tok_dir / "tokenizer.json")).name == a.name  # the same files, the same identity
    other = train_bpe(tmp_path / "other", vocab_size=380)
    assert get_tokenizer(str(other)).name != a.name
    (tmp_path / "same").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "same" / f).write_bytes((tok_dir / f).read_bytes())
    assert get_tokenizer(str(tmp_path / "same")).name == a.name
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "same" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ x }}"}))
    assert get_tokenizer(str(tmp_path / "same")).name != a.name  # another template, another identity


def test_corpus_records_the_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    corpus = build_corpus(SAMPLES, tmp_path / "c", str(tok_dir), source="test")
    for i, text in enumerate(SAMPLES):
        assert corpus[i].tolist() == ref(text)["input_ids"] + [ref.eos_token_id]
    m = open_corpus(tmp_path / "c").manifest
    data = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m.tokenizer == get_tokenizer(str(tok_dir)).name == data["tokenizer"]["name"]
    assert data["tokenizer"]["source"] == str(tok_dir)
    assert set(data["tokenizer"]["sha256"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert data["targets"] == m.target_tokens == m.tokens - m.documents and data["mask"] is False
    assert open_corpus(tmp_path / "c").text(0) == "<s>" + SAMPLES[0]  # decoded with the recorded tokenizer


def test_cli_build_with_a_tokenizer_and_bad_tokenizers(cli, tok_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    out = tmp_path / "corpus"
    res = cli("data", "build", str(src), "--out", str(out), "--tokenizer", str(tok_dir), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokenizer"]["name"] == get_tokenizer(str(tok_dir)).name
    not_json = tmp_path / "notes.txt"
    not_json.write_text("just some words")
    wrong_json = tmp_path / "wrong" / "tokenizer.json"
    wrong_json.parent.mkdir()
    wrong_json.write_text('{"model": {"type": "nothing"}}')
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    cases = {
        str(tmp_path / "missing"): "no such file or directory",
        str(not_json): "not a Hugging Face tokenizer.json",
        str(wrong_json.parent): "not a Hugging Face tokenizer.json",
        str(empty_dir): "no tokenizer.json",
    }
    for spec, needle in cases.items():
        target = tmp_path / "never"
        msg = one_line_error(cli("data", "build", str(src), "--out", str(target), "--tokenizer", spec))
        assert needle in msg and spec in msg, msg
        assert not target.exists() and hidden(tmp_path) == []


def _prepare(tmp_path: Path, **data: object):  # noqa: ANN202
    from hydraulis.training.job import prepare

    config = parse_config(
        {
            "model": {"preset": "tiny"},
            "data": {"tokens_per_batch": 256, "max_len": 128, **data},
            "parallel": {"pool": "1x(tp1,pp1)"},
        }
    )
    return prepare(config, nproc=1, out=str(tmp_path / "run"), steps=1, resume=False)


def test_train_checks_the_tokenizer_before_any_rank(tok_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c"
    build_corpus(SAMPLES * 20, corpus, str(tok_dir), source="test")
    job = _prepare(tmp_path, corpus=str(corpus), tokenizer=str(tok_dir))  # the tiny model's 512 ids hold 400
    assert job.data.tokenizer == str(tok_dir)
    big = train_bpe(tmp_path / "big", vocab_size=600)
    assert get_tokenizer(str(big)).vocab_size > 512
    with pytest.raises(
        HydraulisError,
        match=rf"model.vocab 512 is smaller than .*big tokenizer's {get_tokenizer(str(big)).vocab_size} token ids",
    ):
        _prepare(tmp_path, corpus=str(corpus), tokenizer=str(big))
    with pytest.raises(HydraulisError, match=r"is tokenized with .*bpe \(hf-.*the model needs bytes \(bytes\)"):
        _prepare(tmp_path, corpus=str(corpus), tokenizer="bytes")
    with pytest.raises(HydraulisError, match="unknown tokenizer 'nope'"):
        _prepare(tmp_path, corpus=str(corpus), tokenizer="nope")
    assert not (tmp_path / "run").exists()


def test_auto_is_the_checkpoint_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    from hydraulis.training.job import prepare

    hf = tmp_path / "hf"
    from hydraulis.runtime.storage.hf import hf_config
    from hydraulis.specs import MODELS

    config = hf_config(MODELS["tiny"])  # what `hydraulis export` writes: a config hydraulis reads back
    transformers.LlamaForCausalLM(config).save_pretrained(str(hf))  # weights too: prepare checks their headers
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (hf / f).write_bytes((tok_dir / f).read_bytes())
    corpus = tmp_path / "c"
    build_corpus(SAMPLES * 20, corpus, str(tok_dir), source="test")

    def run(**data: object):  # noqa: ANN202
        cfg = parse_config(
            {
                "model": {"init_from": str(hf)},
                "data": {"tokens_per_batch": 256, "max_len": 128, "corpus": str(corpus), **data},
                "parallel": {"pool": "1x(tp1,pp1)", "profile": "@cpu"},
            }
        )
        return prepare(cfg, nproc=1, out=str(tmp_path / "run"), steps=1, resume=False)

    assert run().data.tokenizer == str(hf)  # auto: the checkpoint's own, the same files as the corpus's
    other = train_bpe(tmp_path / "other", vocab_size=380)
    with pytest.raises(HydraulisError, match=r"data.tokenizer .*other .* is not the tokenizer of model.init_from"):
        run(tokenizer=str(other))
